"""What a ``gpukit train`` run reports: its metrics, the memory of the devices it trained on,
and the files ``metrics.json``, ``metrics.csv`` and ``loss.png``.

>>> import json, tempfile
>>> from pathlib import Path
>>> out = Path(tempfile.mkdtemp())
>>> m = {"workload": "mlp", "strategy": "single", "world_size": 1, "precision": "32"}
>>> write_outputs(out, m, [{"step": 1.0, "loss": 0.9}, {"step": 2.0, "loss": 0.7}])
>>> (out / "metrics.csv").read_text().splitlines()
['step,loss', '1,0.9', '2,0.7']
>>> json.loads((out / "metrics.json").read_text())["workload"]
'mlp'
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from gpukit.diagnostics.memory import DeviceMemory, MemoryReport
from gpukit.diagnostics.memory import report as memory_report
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import Workload
from gpukit.workloads.flops import mfu


def metrics(
    rt: Runtime,
    workload: Workload,
    *,
    samples_per_s: float,
    seconds: float,
    global_batch: int,
    memory: MemoryReport,
    config: dict[str, Any],
) -> dict[str, Any]:
    """The summary of a finished run with ``rt``, as ``metrics.json`` holds it.

    ``memory`` is :func:`run_memory` of the run, ``config`` what it was asked to do (as a dict).
    MFU is given on GPUs of known peak (see :func:`gpukit.workloads.flops.mfu`), else None.

    >>> import gpukit as gk
    >>> from gpukit.workloads import load_workload
    >>> rt = gk.Runtime(devices="cpu")
    >>> m = metrics(rt, load_workload("mlp"), samples_per_s=1e3, seconds=2.0, global_batch=64,
    ...             memory=run_memory(rt), config={})
    >>> m["steps"], m["strategy"], m["mfu"], list(m["peak_memory"])
    (0, 'single', None, ['cpu'])
    """
    flops_per_s = workload.flops_per_sample * samples_per_s
    # PEAK_FLOPS lists GPUs: a CPU's model name must not match one of them by chance.
    utilisation = (
        mfu(flops_per_s, rt.device_info.name, gpu_count(rt)) if rt.device.type == "cuda" else None
    )
    losses = [r["loss"] for r in rt.history if "loss" in r]
    return {
        "workload": workload.name,
        "final_loss": losses[-1] if losses else None,
        "steps": rt.global_step,
        "samples_per_s": samples_per_s,
        "seconds": seconds,
        "global_batch": global_batch,
        "world_size": rt.world_size,
        "strategy": rt.strategy.name,
        "precision": rt.precision.name,
        "devices": [str(d) for d in rt.strategy.devices],
        "mfu": utilisation,
        "peak_memory": {_row_name(row): row.peak for row in memory.rows},
        "memory": memory.to_dict(),
        "micro_batch": -(-global_batch // (rt.world_size * rt.accumulate * rt.oom_split)),
        "oom_retries": rt.oom_events,
        "config": config,
    }


def gpu_count(rt: Runtime) -> int:
    """GPUs a run with ``rt`` trains on over all its processes, for MFU: one per process under
    DDP, and every device of a single process that drives several (dp).

    >>> import gpukit as gk
    >>> gpu_count(gk.Runtime(strategy="dp", devices="cpu,cpu,cpu"))
    3
    """
    return rt.world_size * len(rt.strategy.driven_devices)


def run_memory(rt: Runtime) -> MemoryReport:
    """Memory of every device the run trained on: all of a dp run's GPUs, each rank's under
    DDP (gathered, so every rank must call it), the process's RAM on a CPU.

    >>> import gpukit as gk
    >>> [row.device for row in run_memory(gk.Runtime(devices="cpu")).rows]
    ['cpu']
    """
    used = [d.torch for d in rt.strategy.driven_devices if d.type == "cuda"]
    return memory_report(used or ["cpu"])


def _row_name(row: DeviceMemory) -> str:
    return row.device if row.rank is None else f"{row.device} (rank {row.rank})"


def write_outputs(out: Path, metrics: dict[str, Any], history: list[dict[str, float]]) -> None:
    """metrics.json, metrics.csv (the logged history) and loss.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    names = sorted({k for row in history for k in row} - {"step"})
    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *names])
        for row in history:
            writer.writerow([int(row["step"]), *(row.get(n, "") for n in names)])
    _plot_loss(out / "loss.png", history, metrics)


def _plot_loss(path: Path, history: list[dict[str, float]], metrics: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    rows = [r for r in history if "loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(
        f"{metrics['workload']}: {metrics['strategy']} x{metrics['world_size']}, "
        f"{metrics['precision']}"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
