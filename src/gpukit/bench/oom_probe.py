"""A real out-of-memory error on a GPU, recovered: the check behind ``make gpu-check``'s
``oom`` line.

Out-of-memory recovery is tested everywhere with an injected fault; this runs the real thing.
The GPU's allocator is capped (``torch.cuda.set_per_process_memory_fraction``) so that a
training step of the ``gpt`` workload at a large batch cannot fit, whatever the card's size,
while the same step cut into a few micro-batches can:

1. measure one step's peak memory at batch ``b`` and ``2b`` (without a cap): the difference is
   what ``b`` more samples need; the rest is weights, gradients, optimizer state and caches;
2. cap the allocator at that fixed part plus 3 times what ``b`` samples need;
3. train ``gpukit train``'s loop with the global batch ``8b`` and ``oom="recover"``: the first
   step runs out of memory for real (CUDA's allocator raises ``torch.OutOfMemoryError``), the
   Runtime cuts the batch into more micro-batches, redoes the step, and training goes on.

It passes when at least one recovery happened, the run finished its steps, and the loss is
finite. Prints one JSON line with what happened; exit status 0 on success.
"""

from __future__ import annotations

import gc
import json
import math
import sys
from typing import Any

import torch

BATCH = 32  # samples per probe batch; the failing batch is 8 times this
STEPS = 3


def _peak_of_one_step(batch: int, device: torch.device) -> int:
    """Bytes at the peak of one optimizer step of gpt at ``batch`` samples on ``device``."""
    from gpukit.runtime.runtime import Runtime
    from gpukit.train.loop import TrainConfig, fit

    torch.cuda.init()  # the allocator's statistics can only be reset once CUDA has started
    gc.collect()  # an earlier run's model sits in reference cycles until collected
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    config = TrainConfig(
        workload="gpt", max_steps=1, batch_size=batch, progress=False, sample=False
    )
    rt = Runtime(devices=str(device), precision="32", oom="raise")
    try:
        rt.launch(fit, config)
    finally:
        rt.teardown()
    return int(torch.cuda.max_memory_allocated(device))


def probe(device: torch.device) -> dict[str, Any]:
    """Run the probe on ``device`` (a CUDA GPU); what happened, as a JSON-ready dict."""
    from gpukit.runtime.runtime import Runtime
    from gpukit.train.loop import TrainConfig, fit

    one, two = _peak_of_one_step(BATCH, device), _peak_of_one_step(2 * BATCH, device)
    per_batch = max(two - one, 1)
    fixed = max(one - per_batch, 0)
    # The cap bounds reserved memory, which the allocator takes in whole segments (2 MiB
    # blocks, 20 MiB for mid-size ones): three batches' worth of room lets 2b fit with a
    # batch to spare while 4b and 8b cannot, whatever the rounding.
    cap = fixed + 3 * per_batch
    total = torch.cuda.get_device_properties(device).total_memory
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0), device)
    try:
        config = TrainConfig(
            workload="gpt", max_steps=STEPS, batch_size=8 * BATCH, progress=False, sample=False
        )
        rt = Runtime(devices=str(device), precision="32", oom="recover")
        try:
            summary = rt.launch(fit, config)
        finally:
            rt.teardown()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    loss = summary.get("final_loss")
    recovered = bool(summary.get("oom_retries"))
    return {
        "device": torch.cuda.get_device_name(device),
        "cap_bytes": cap,
        "bytes_per_extra_batch": per_batch,
        "global_batch": 8 * BATCH,
        "micro_batch": summary.get("micro_batch"),
        "oom_retries": summary.get("oom_retries"),
        "steps": summary.get("steps"),
        "final_loss": loss,
        "ok": recovered
        and summary.get("steps") == STEPS
        and loss is not None
        and math.isfinite(loss),
    }


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA GPU: the probe needs one"}))
        return 2
    try:
        result = probe(torch.device("cuda", 0))
    except Exception as err:  # the judge reads one line: a failure must still leave it
        print(json.dumps({"ok": False, "error": f"{type(err).__name__}: {err}"}))
        raise
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
