#!/usr/bin/env bash
# The GPU check, then a 1.24e9-parameter Llama (Llama 3.2 1B's shape, built on the meta device)
# trained for a few steps on one GPU per variant, each beside the planner's prediction for it.
# Run from the repository root: OUT=folder bash benchmarks/results/2026-11-26-h100-large/run.sh
set -u
export PYTHONPATH=src
R=/tmp/results; mkdir -p $R; START=$SECONDS
W=gpukit.workloads.llama:llama3_2_1b
{ date -u; nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } > $R/nvidia-smi.txt 2>&1
timeout 230 python3 -m gpukit.bench.gpu_check --out $R/gpucheck --only doctor,oom,train-auto,train-32,tests --budget 200 > $R/gpucheck.txt 2>&1
echo "gpu-check rc=$? at $((SECONDS-START)) s" >> $R/timeline.txt
variant() {  # name, plan flags, train flags
  local name=$1 plan=$2 train=$3
  if (( SECONDS - START > 470 )); then echo "$name skipped (time)" >> $R/timeline.txt; return; fi
  timeout 60 python3 -m gpukit plan --workload $W --devices 1 --batch-size 4 --json $plan > $R/plan-$name.json 2> $R/plan-$name.err
  echo "$name plan rc=$? at $((SECONDS-START)) s" >> $R/timeline.txt
  timeout 100 python3 -m gpukit train --workload $W --devices cuda --batch-size 4 --max-steps 6 $train > $R/train-$name.txt 2>&1
  echo "$name train rc=$? at $((SECONDS-START)) s" >> $R/timeline.txt
}
variant fsdp-bf16 "--strategies fsdp --fsdp-mixed bf16 --precision 32" "--strategy fsdp --fsdp-mixed bf16 --precision 32"
variant fsdp-bf16-selective "--strategies fsdp --fsdp-mixed bf16 --precision 32 --activation-checkpointing selective" "--strategy fsdp --fsdp-mixed bf16 --precision 32 --activation-checkpointing selective"
variant single-bf16mixed "--strategies single --precision bf16-mixed" "--strategy single --precision bf16-mixed"
variant fsdp-bf16-full "--strategies fsdp --fsdp-mixed bf16 --precision 32 --activation-checkpointing full" "--strategy fsdp --fsdp-mixed bf16 --precision 32 --activation-checkpointing full"
tar czf $OUT/results.tgz -C $R .
echo "total $((SECONDS-START)) s"; cat $R/timeline.txt; tail -5 $R/gpucheck.txt
