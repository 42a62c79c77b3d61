"""``strategies``: which multi-GPU strategy trains fastest, and what it does to memory on the
first GPU.

Every strategy of the registry (:data:`gpukit.strategies.STRATEGIES`: one added there joins by
itself; ``auto`` only picks one of them) trains the ``cnn`` and ``gpt`` workloads through the
loop behind ``gpukit train`` (:func:`gpukit.train.loop.fit`, with that command's default
Runtime settings) on 1, 2, ... N GPUs. Per configuration: samples/s, scaling efficiency, GPU
utilisation, peak memory of the first device and of the others, and their ratio; the peak of
live tensors of the first device and of the fullest other, beside the planner's prediction.

Method:

- **Weak scaling**: every device trains on the workload's batch, so k devices take k times
  the samples per step. Scaling efficiency = samples/s(k) / (k x samples/s(1 device)), the
  1-device rate being the same strategy's, or that of a strategy that takes one device.
- **Steady state by difference**: ``fit``'s samples/s counts from its first step, which pays
  for one-time costs (CUDA context, cuDNN and cuBLAS set-up, allocator growth, optimizer
  state). Each configuration runs ``fit`` twice, for ``warmup`` and for ``warmup + steps``
  steps; the difference of their loop times is what ``steps`` steady steps take. Runs in this
  process follow one untimed run (some first-use costs are paid once per process); each
  launch of DDP starts fresh processes, so both of its runs pay the same start.
- **Memory**: the memory report of the longer run (gathered from every rank under DDP), peaks
  reset before each run, memory freed after it. Beside it, the model state per rank: the
  bytes of weights, gradients and optimizer state the fullest rank holds (``gk.memory
  .breakdown`` on each rank: under fsdp its shards, about 1/N), which the process peak of a
  CPU run (torch itself included) hides for small models.
- **GPU utilisation**: NVML sampled from this process (it sees DDP's processes too), kept over
  the span of the training loop.
- **Planner vs measurement**: ``fit`` records each device's peak of live tensors over its
  first 3 optimizer steps (``peak_tensors``, any run has it); after the runs, untimed, the
  planner predicts it at the run's micro-batch and precision (:mod:`gpukit.bench.prediction`).

A configuration that cannot run here is a row whose status says why, never a missing row.
The configurations and their settings are :mod:`gpukit.bench.strategy_configs`'s; training
and timing one is :mod:`gpukit.bench.strategy_runs`'s.

>>> quick, full = settings(quick=True, gpus=0), settings(quick=False, gpus=8)
>>> quick.workloads, full.workloads, full.counts[-1]
(('gpt',), ('cnn', 'gpt'), 8)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit.bench import strategy_runs
from gpukit.bench.environment import environment_of
from gpukit.bench.measure import check_devices
from gpukit.bench.plotting import bar_labels, figure
from gpukit.bench.prediction import predict, tensor_columns
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.strategy_configs import (
    WORKLOADS,
    Planned,
    StrategySweep,
    default_batch,
    kind,
    plan,
    settings,
)
from gpukit.strategies import STRATEGIES
from gpukit.train.loop import RUNTIME_DEFAULTS

TITLE = "Which multi-GPU strategy is fastest, and what does it do to memory on the first GPU?"
MiB = 2**20

COLUMNS = (
    Column("workload"),
    Column("strategy"),
    Column("devices"),
    Column("samples_per_s", "samples/s", "", 0),
    Column("efficiency", "scaling", "", 2),
    Column("gpu_util", "GPU util", "%", 0),
    Column("peak_first", "peak 1st", "MiB", 0),
    Column("state_rank", "state/rank", "MiB", 2),
    Column("imbalance", "1st/others", "", 2),
    Column("tensors_first", "tensors 1st", "MiB", 2),
    Column("tensors_others", "tensors others", "MiB", 2, compare=False),
    Column("predicted_first", "predicted 1st", "MiB", 2, compare=False),
    Column("predicted_others", "predicted others", "MiB", 2, compare=False),
    Column("tensors_error", "error", "%", 2),
    Column("status"),
)


def run(quick: bool = False, devices: Sequence[torch.device] | None = None) -> BenchResult:
    """Train every configuration of :func:`plan` on the GPUs among ``devices`` (default: every
    GPU present; without GPUs, CPU processes) and report them (see the module docstring)."""
    gpus = [d for d in check_devices(devices, "strategies") if d.type == "cuda"]
    s = settings(quick, len(gpus))
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for p in plan(s.workloads, [str(d) for d in gpus], s.counts):
        row, raw = _configuration(p, s)
        rows.append(row)
        runs.append(raw)
    _add_efficiency(rows)
    return BenchResult(
        experiment="strategies",
        title=TITLE,
        keys=("workload", "strategy", "devices"),
        columns=COLUMNS,
        rows=rows,
        summary=_summary(rows),
        notes=_notes(bool(gpus)),
        parameters=_parameters(quick, s, gpus),
        environment=environment_of(gpus or [torch.device("cpu")]),
        raw={"runs": runs},
    )


def _configuration(p: Planned, s: StrategySweep) -> tuple[dict[str, Any], dict[str, Any]]:
    """The table row and the raw figures of one configuration; failures become its status."""
    row: dict[str, Any] = {"workload": p.workload, "strategy": p.strategy, "devices": p.count}
    raw: dict[str, Any] = {**row, "device_list": list(p.devices or [])}
    if p.devices is None:
        return {**row, "status": p.reason}, {**raw, "status": p.reason}
    try:
        rounds, last = strategy_runs.measure_configuration(p, s)
    except Exception as err:  # one broken configuration must not cost the others
        reason = f"{type(err).__name__}: {err}"
        short = ": ".join(reason.split(": ", 2)[:2])  # the error's type and its first clause
        return {**row, "status": f"failed: {short}"}, {**raw, "status": reason}
    peaks = [m["peak"] for m in last["memory"]]
    utils = [u["mean"] for u in last["utilization"].values() if u is not None]
    row.update(
        samples_per_s=statistics.median(r["samples_per_s"] for r in rounds),
        gpu_util=sum(utils) / len(utils) if utils else None,
        peak_first=peaks[0] / MiB,
        peak_others=sum(peaks[1:]) / len(peaks[1:]) / MiB if peaks[1:] else None,
        imbalance=_imbalance(last["memory"]),
        state_rank=max(last["model_state"]) / MiB if last.get("model_state") else None,
        status="ran",
    )
    raw.update(status="ran", rounds=rounds, **last)
    # Outside the timed runs (a simulation takes about a second); as the run ran.
    ran_as = {"micro_batch": last["micro_batch"], "precision": last["precision"]}
    raw["prediction"] = predict(p.workload, p.strategy, p.devices, **ran_as)
    row.update(tensor_columns(last["memory"], raw["prediction"]["peaks"]))
    return row, raw


def _imbalance(memory: list[dict[str, Any]]) -> float | None:
    """The first device's peak over the mean of the others' (None for one device)."""
    others = [m["peak"] for m in memory[1:]]
    return memory[0]["peak"] / (sum(others) / len(others)) if others and sum(others) else None


# -- the result ----------------------------------------------------------------------------


def _add_efficiency(rows: list[dict[str, Any]]) -> None:
    one_device = [n for n in STRATEGIES if kind(n)[0]]
    base = {
        (r["workload"], r["strategy"]): r["samples_per_s"]
        for r in rows
        if r["devices"] == 1 and r.get("samples_per_s")
    }
    for r in rows:
        w = r["workload"]
        fallback = next((base[(w, n)] for n in one_device if (w, n) in base), None)
        reference = base.get((w, r["strategy"])) or fallback
        if r.get("samples_per_s") and reference:
            r["efficiency"] = r["samples_per_s"] / (r["devices"] * reference)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ran = [r for r in rows if r["workload"] == workload and r.get("samples_per_s")]
        if ran:
            best = max(ran, key=lambda r: r["samples_per_s"])
            summary[f"fastest on {workload}"] = (
                f"{best['strategy']} x{best['devices']} ({best['samples_per_s']:.0f} samples/s)"
            )
        for name in dict.fromkeys(r["strategy"] for r in ran):
            several = [r for r in ran if r["strategy"] == name and r.get("imbalance")]
            if several:
                widest = max(several, key=lambda r: r["devices"])
                key = f"1st/others peak, {name} x{widest['devices']} on {workload}"
                summary[key] = widest["imbalance"]
        predicted = [r for r in ran if r.get("tensors_error") is not None]
        if predicted:
            worst = max(predicted, key=lambda r: abs(r["tensors_error"]))
            summary[f"largest prediction error on {workload}"] = (
                f"{worst['tensors_error']:+.2f}% ({worst['strategy']} x{worst['devices']})"
            )
    return summary


def _notes(gpus: bool) -> list[str]:
    notes = [
        "samples/s: steady state, from the difference of two fit runs (warmup and warmup+steps "
        "steps), median over rounds; weak scaling: each device trains on the workload's batch.",
        "scaling eff. = samples/s(k) / (k x samples/s at 1 device, same strategy, else a "
        "one-device strategy); 1.0 is the limit: data parallelism adds the gradient all-reduce "
        "(about 2(k-1)/k x the gradient bytes per device per step), dp and dp-balanced also "
        "copy the weights from the first device every step, and a step bound by the host "
        "(data loading, Python, kernel launches) does not scale at all.",
        "peak: most memory allocated per device during the run (torch's caching allocator; on "
        "a CPU the process's peak resident memory, torch itself included); 1st/others: the "
        "first device's peak over the mean of the others'. Under dp the first GPU also holds "
        "the gathered outputs, the loss and their gradients; under dp-balanced only the master "
        "weights, gradients and optimizer state set it apart; under ddp and fsdp about 1.0.",
        "state/rank: weights, gradients and optimizer state held by the fullest rank; every "
        "rank holds them whole under ddp and the others, about 1/k of them under fsdp (its "
        "shards; it gathers a block's weights only while computing with it).",
        "GPU util: NVML's share of time a kernel was running (not the share of compute used), "
        "sampled every 75 ms over each run's training loop, mean over the devices.",
        "tensors: peak of live tensors over the first 3 optimizer steps (no CUDA context or "
        "cached blocks), first device and fullest other; predicted: the planner's, simulated "
        "(closed form for dp, dp-balanced: raw.runs[].prediction says which and why); error: "
        "(predicted - measured) / measured, the larger of the two devices'.",
    ]
    if not gpus:
        notes.append(
            "No GPU here: 'devices' are CPU processes sharing the same cores (each of k "
            "processes gets cores/k threads), so scaling measures overhead, not speed-up; "
            "strategies that drive several devices from one process need 2+ CUDA GPUs."
        )
    return notes


def _parameters(quick: bool, s: StrategySweep, gpus: list[torch.device]) -> dict[str, Any]:
    skipped = ", ".join(w for w in WORKLOADS if w not in s.workloads)
    return {
        "quick": quick,
        "workloads": list(s.workloads),
        "device_counts": list(s.counts),
        "per_device_batch": s.batch or {w: default_batch(w) for w in s.workloads},
        "warmup_steps": s.warmup,
        "timed_steps": s.steps,
        "rounds": s.rounds,
        "strategies": list(STRATEGIES),
        "runtime": {k: v for k, v in RUNTIME_DEFAULTS.items() if k not in ("strategy", "devices")},
        "gpus": [str(d) for d in gpus],
        "quick_skipped": f"workloads {skipped}; device counts above 2; rounds beyond 1; steps "
        f"({s.warmup} + {s.steps} instead of 5 + 40); the workloads' own batch (16 per device "
        "instead)"
        if quick
        else None,
    }


def plot(result: BenchResult, path: Path) -> None:
    """Samples/s per configuration and workload (bars), and beside it the peak memory per
    device where a strategy driving several devices from one process ran on several."""
    import numpy as np

    rows = result.rows
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    configs = list(dict.fromkeys((r["strategy"], r["devices"]) for r in rows))
    rates = [r["samples_per_s"] for r in rows if r.get("samples_per_s")]
    logy = bool(rates) and max(rates) > 20 * min(rates)  # workloads far apart: log scale
    memory = _memory_runs(result)
    env = result.environment
    gpus = [d["name"] for d in env.get("devices", []) if str(d["device"]).startswith("cuda")]
    machine = f"up to {len(gpus)} x {gpus[0]}" if gpus else f"CPU processes, {env.get('cpu')}"
    title = f"Training throughput per strategy ({machine})"
    ylabel = "samples/s" + (" (log scale)" if logy else "")
    size = (max(12.0, 4 + 0.45 * len(configs) * len(workloads)), 5.0)
    with figure(path, title, "strategy x devices", ylabel, logy=logy, size=size) as ax:
        if memory:
            grid = ax.figure.add_gridspec(1, 2, width_ratios=(2, 1))
            ax.set_subplotspec(grid[0])
        x = np.arange(len(configs))
        width = 0.8 / max(len(workloads), 1)
        for i, workload in enumerate(workloads):
            mine = {(r["strategy"], r["devices"]): r for r in rows if r["workload"] == workload}
            values = [(mine.get(c) or {}).get("samples_per_s") for c in configs]
            offsets = x + (i - (len(workloads) - 1) / 2) * width
            shown = [(o, v) for o, v in zip(offsets, values, strict=True) if v]
            if shown:
                bars = ax.bar([o for o, _ in shown], [v for _, v in shown], width, label=workload)
                bar_labels(ax, bars, "{:.0f}")
            for o in (o for o, v in zip(offsets, values, strict=True) if not v):
                where = ("data", "axes fraction")  # at the foot, whatever the scale
                ax.annotate(
                    "not run",
                    (o, 0.02),
                    xycoords=where,
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="grey",
                )
        ax.set_xticks(x, [f"{n} x{k}" for n, k in configs], rotation=30, ha="right")
        if memory:
            _plot_memory(ax.figure.add_subplot(grid[1]), memory)


def _memory_runs(result: BenchResult) -> list[dict[str, Any]]:
    """What the memory panel shows: at the most devices where a strategy driving several
    devices from one process ran, on the workload where one of them is the most imbalanced,
    every strategy that ran on as many devices there (ddp for reference)."""
    runs = [r for r in result.raw.get("runs", []) if r.get("status") == "ran"]
    one_process = [r for r in runs if r.get("in_process") and len(r["memory"]) > 1]
    if not one_process:
        return []
    widest = max(len(r["memory"]) for r in one_process)
    at = [r for r in one_process if len(r["memory"]) == widest]
    workload = max(at, key=lambda r: _imbalance(r["memory"]) or 0.0)["workload"]
    return [r for r in runs if r["workload"] == workload and len(r["memory"]) == widest]


def _plot_memory(ax: Any, chosen: list[dict[str, Any]]) -> None:
    import numpy as np

    widest = len(chosen[0]["memory"])
    x = np.arange(widest)
    width = 0.8 / len(chosen)
    for i, run in enumerate(chosen):
        offsets = x + (i - (len(chosen) - 1) / 2) * width
        bars = ax.bar(
            offsets, [m["peak"] / MiB for m in run["memory"]], width, label=run["strategy"]
        )
        bar_labels(ax, bars, "{:.0f}")
    ax.set_xticks(x, [f"device {i}" for i in range(widest)])
    ax.set_title(f"Peak memory per device: {chosen[0]['workload']}, {widest} devices", fontsize=11)
    ax.set_xlabel("device (in the order the strategy uses them)")
    ax.set_ylabel("peak allocated (MiB)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
