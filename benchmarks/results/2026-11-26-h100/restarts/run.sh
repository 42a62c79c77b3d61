#!/bin/bash
# Restart time split: the launcher before (bench_old/src) and after (src), same machine, turns.
export OMP_NUM_THREADS=1
W=/tmp/w; mkdir -p $W/jobs
python3 - > $W/prog.py <<'PY'
import sys; sys.path.insert(0, ".")
import ast, re
text = open("tests/launch/test_multinode.py").read()
start = text.index('PROGRAM = """') + len('PROGRAM = """')
print(text[start:text.index('""".replace', start)].replace("PERIODIC", "4"))
PY
one() {  # $1 label, $2 src
  GPUKIT_FAULT=raise:1:3 PYTHONPATH=$2 timeout 120 python3 -m gpukit train --workload mlp --strategy ddp --devices cpu,cpu --max-steps 5 --max-restarts 1 --out $W/jobs/$1-$RANDOM > $W/jobs/$1.log 2>&1
  grep -h "restart 1:" $W/jobs/$1.log | sed "s/^/$1: /" | tee -a $W/split-1node.txt; }
for i in 1 2 3; do one before bench_old/src; one after src; done
nodes() {  # $1 nnodes, $2 nproc, $3 label
  d=$W/jobs/n$1-$3; mkdir -p $d; cp $W/prog.py $d/train.py
  P=$(PYTHONPATH=src python3 -c "from gpukit.launch.spawn import free_port;print(free_port())")
  for r in $(seq 0 $(($1-1))); do (cd $d && GPUKIT_FAULT=raise:1:6 PYTHONPATH=$OLDPWD/src timeout 150 python3 -m gpukit launch --nproc $2 --nnodes $1 --node-rank $r --master-addr 127.0.0.1 --master-port $P --max-restarts 1 train.py 12 > node$r.log 2>&1) & done; wait
  grep -h "restart 1:" $d/node*.log | sed "s/^/nnodes=$1 nproc=$2 $3: /" | tee -a $W/split-nodes.txt; }
for i in 1 2 3; do nodes 1 2 r$i; nodes 2 1 r$i; nodes 3 1 r$i; done
PYTHONPATH=src timeout 200 python3 -m gpukit bench restarts --out $W/bench-restarts > $W/bench-restarts.txt 2>&1; tail -15 $W/bench-restarts.txt
nproc > $W/machine.txt; cat /proc/loadavg >> $W/machine.txt; python3 -c "import torch;print(torch.__version__)" >> $W/machine.txt
find $W -name "*.safetensors" -delete; find $W -name "*.pt" -delete; tar czf $OUT/w.tgz -C $W . ; cat $W/split-1node.txt $W/split-nodes.txt
