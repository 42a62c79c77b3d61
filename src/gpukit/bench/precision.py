"""``precision``: how much faster training gets in bf16-mixed or 16-mixed than in float32, with
channels_last or ``torch.compile``, and whether it still trains as well.

On each device (the CPU and every GPU), the ``cnn`` and ``gpt`` workloads train in every
variant from the same weights on the same batches: a one-device Runtime with the variant's
precision, the workload's model, loss and learning rate, AdamW, ``rt.train_step``. Variants:

- ``fp32`` (precision "32"), ``bf16-mixed``, ``16-mixed`` (float16 with a gradient scaler; a
  CUDA GPU only, as gpukit refuses it elsewhere);
- ``channels_last``: model and inputs in NHWC memory order (image workloads only), alone and
  with bf16-mixed, where GPUs' tensor-core convolutions want it;
- ``compile``: the model under ``torch.compile``, alone and with bf16-mixed.

Method (see :mod:`gpukit.bench.timing`): the model is seeded, and a pool of batches is drawn
with a fixed seed and placed on the device before any timing, so every variant sees the same
numbers. Each variant runs ``warmup`` steps untimed (``torch.compile`` compiles in them); then
``rounds`` rounds each time a block of ``steps`` steps of every variant, the order rotated
between rounds, the device synchronised before each clock read and the garbage collector off.
Reported: the median seconds per step, and the speed-up as the median of the per-round ratios
to fp32 (timings taken moments apart, so the machine's drifts cancel out). The losses stay on
the device; the final loss (the mean over a variant's last block) is read back once, at the
end. It shows that the faster variant still trains: compare it with fp32's (``Δ loss``).

>>> [v.name for v in variants(image=False)]
['fp32', 'bf16-mixed', '16-mixed', 'compile', 'bf16-mixed + compile']
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.measure import check_devices, device_name, tf32_matmul
from gpukit.bench.plotting import bar_labels, figure
from gpukit.bench.precision_trainer import (
    POOL,
    SEED,
    PrecisionTiming,
    Trainer,
    Variant,
    batch_pool,
    free,
    guarded,
)
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import synchronizer, time_rounds
from gpukit.errors import ConfigError
from gpukit.workloads import load_workload

TITLE = "fp32 vs bf16-mixed vs 16-mixed, channels_last and torch.compile: speed and final loss"
WORKLOADS = ("cnn", "gpt")
# On a GPU these workloads' own batches leave it idle between kernel launches, where no
# precision can help: a larger batch makes the step the GPU's work.
GPU_BATCH_FACTOR = 32

COLUMNS = (
    Column("device"),
    Column("workload"),
    Column("variant"),
    Column("samples_per_s", "samples/s", "", 0),
    Column("speedup", "x fp32", "", 2),
    Column("final_loss", "final loss", "", 4),
    Column("loss_delta", "Δ loss vs fp32", "", 4),
    Column("status"),
)


BASELINE = Variant("fp32", "32")
VARIANTS = (
    BASELINE,
    Variant("bf16-mixed", "bf16-mixed"),
    Variant("16-mixed", "16-mixed"),
    Variant("channels_last", "32", channels_last=True),
    Variant("bf16-mixed + channels_last", "bf16-mixed", channels_last=True),
    Variant("compile", "32", compile=True),
    Variant("bf16-mixed + compile", "bf16-mixed", compile=True),
)


def variants(image: bool) -> list[Variant]:
    """The variants for a workload; channels_last only where inputs are images (N, C, H, W)."""
    return [v for v in VARIANTS if image or not v.channels_last]


def settings(quick: bool) -> PrecisionTiming:
    """Quick: a few steps; full: enough for a stable median.

    >>> settings(quick=True).rounds
    2
    """
    if quick:
        return PrecisionTiming(warmup=2, steps=4, rounds=2, cpu_batch=8)
    return PrecisionTiming(warmup=5, steps=20, rounds=5, cpu_batch=None)


def run(quick: bool = False, devices: Sequence[torch.device] | None = None) -> BenchResult:
    """Train every workload in every variant on each of ``devices`` (default: the CPU and
    every GPU) and report speed and final loss (see the module docstring)."""
    chosen = check_devices(devices, "precision")
    s = settings(quick)
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for dev in chosen:
        for workload in WORKLOADS:
            spec = load_workload(workload, seed=SEED)
            image = spec.dataset[0][0].dim() == 3
            batch = _batch(spec.batch_size, dev, s)
            # With a GPU here, compiling for the CPU as well (minutes) would only delay the
            # GPU's answer: the CPU's compile rows are measured on machines without one.
            skip_cpu_compile = quick or any(d.type == "cuda" for d in chosen)
            for row, raw in compare(dev, workload, variants(image), batch, s, skip_cpu_compile):
                rows.append(row)
                runs.append(raw)
    return BenchResult(
        experiment="precision",
        title=TITLE,
        keys=("device", "workload", "variant"),
        columns=COLUMNS,
        rows=rows,
        summary=_summary(rows),
        notes=_notes(),
        parameters=_parameters(quick, s, chosen),
        environment=environment_of(chosen),
        raw={"runs": runs},
    )


def _batch(default: int, dev: torch.device, s: PrecisionTiming) -> int:
    if dev.type == "cuda":
        return default * GPU_BATCH_FACTOR
    return s.cpu_batch or default


# -- the variants of one workload on one device --------------------------------------------


def compare(
    dev: torch.device,
    workload: str,
    chosen: Sequence[Variant],
    batch: int,
    s: PrecisionTiming,
    skip_cpu_compile: bool = False,
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The row and raw figures of each variant of ``workload`` on ``dev``, timed together in
    rotated rounds; what stops a variant becomes its status.

    >>> s = PrecisionTiming(warmup=1, steps=2, rounds=2, cpu_batch=None)
    >>> found = compare(torch.device("cpu"), "mlp", [BASELINE], 8, s)
    >>> [(row["variant"], row["speedup"], row["loss_delta"]) for row, _ in found]
    [('fp32', 1.0, 0.0)]
    """
    trainers: dict[str, Trainer] = {}
    status: dict[str, tuple[str, str]] = {}  # variant -> (short status, whole reason)
    pools: dict[bool, list[Any]] = {}  # by channels_last: one copy of the batches each
    try:
        for v in chosen:
            if v.compile and dev.type == "cpu" and skip_cpu_compile:
                reason = (
                    "skipped: compiling for a CPU takes minutes (quick mode, or a GPU is "
                    "here: run on a CPU-only machine to measure it)"
                )
                status[v.name] = (reason, reason)
                continue
            try:
                if v.channels_last not in pools:
                    pools[v.channels_last] = batch_pool(workload, batch, dev, v.channels_last)
                trainer = Trainer(dev, workload, v, pools[v.channels_last])
                trainers[v.name] = trainer
                trainer.run(s.warmup)  # torch.compile compiles here
            except Exception as err:
                status[v.name] = _why(err)
                trainers.pop(v.name, None)
        timings = time_rounds(
            {name: guarded(t, s.steps) for name, t in trainers.items()},
            s.rounds,
            per=s.steps,
            warmup=0,
            synchronize=synchronizer(dev),
        )
        losses = {name: t.final_loss() for name, t in trainers.items() if t.error is None}
    finally:
        for t in trainers.values():
            t.close()
        pools.clear()
        free(any(v.compile for v in chosen))
    found = []
    base = BASELINE.name if BASELINE.name in losses else None
    for v in chosen:
        row: dict[str, Any] = {"device": str(dev), "workload": workload, "variant": v.name}
        raw: dict[str, Any] = {**row, "batch": batch, "precision": v.precision}
        failed = trainers[v.name].error if v.name in trainers else None
        if failed is not None:
            status[v.name] = _why(failed)
        if v.name not in losses:
            short, whole = status[v.name]
            found.append(({**row, "status": short}, {**raw, "status": whole}))
            continue
        row.update(
            samples_per_s=batch / timings.median(v.name),
            speedup=timings.ratio(base, v.name) if base else None,
            final_loss=losses[v.name],
            loss_delta=losses[v.name] - losses[base] if base else None,
            status="ran",
        )
        raw.update(status="ran", seconds_per_step=list(timings.seconds[v.name]))
        found.append((row, raw))
    return found


def _why(err: Exception) -> tuple[str, str]:
    """(status, whole reason) for an error: the Runtime's refusal by its first clause, any
    other failure by its type and first line."""
    if isinstance(err, ConfigError):
        return str(err).split(": ", 1)[0], str(err)
    text = f"{type(err).__name__}: {err}".strip()
    return f"failed: {text.splitlines()[0][:100]}", text[:2000]


# -- the result ----------------------------------------------------------------------------


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in dict.fromkeys((r["device"], r["workload"]) for r in rows):
        ran = [r for r in rows if (r["device"], r["workload"]) == key and r.get("speedup")]
        if ran:
            best = max(ran, key=lambda r: r["speedup"])
            summary[f"fastest on {key[0]}, {key[1]}"] = (
                f"{best['variant']} ({best['speedup']:.2f}x)"
            )
    deltas = [abs(r["loss_delta"]) for r in rows if r.get("loss_delta") is not None]
    if deltas:
        summary["largest |Δ loss| vs fp32"] = max(deltas)
    return summary


def _notes() -> list[str]:
    return [
        "x fp32: samples/s over fp32's on the same device and workload, in the same run; "
        "median of the per-round ratios. Δ loss: final loss minus fp32's (same weights, same "
        "batches). Rounding sends the runs along slightly different paths, so Δ grows with "
        "the steps (most near a plateau of the loss, which one run may leave sooner); a "
        "variant that does not train shows a loss far above fp32's, or NaN.",
        "The limit: a step bound by arithmetic gains at most the ratio of the GPU's peaks "
        "(H100: about 990 TFLOP/s dense bf16/fp16 against 67 fp32, TF32 495); one bound by "
        "memory gains at most 2x (half the bytes); one bound by kernel launches and Python "
        "gains nothing, and casts add launches. fp32 matmuls run in full float32 (torch's "
        "default), convolutions in TF32 on GPUs that have it (cuDNN's default).",
        "On GPUs the batch is the workload's x32, so the step is the GPU's work rather than "
        "launch overhead; on a CPU without bfloat16 units (AMX, AVX512-BF16) bf16-mixed is "
        "emulated and slower. torch.compile's first steps compile (and are untimed).",
    ]


def _parameters(quick: bool, s: PrecisionTiming, devices: list[torch.device]) -> dict[str, Any]:
    return {
        "quick": quick,
        "devices": [device_name(d) for d in devices],
        "workloads": list(WORKLOADS),
        "variants": [v.__dict__ for v in VARIANTS],
        "warmup_steps": s.warmup,
        "timed_steps_per_block": s.steps,
        "blocks": s.rounds,
        "cpu_batch": s.cpu_batch or "the workload's",
        "gpu_batch": f"the workload's x {GPU_BATCH_FACTOR}",
        "batch_pool": POOL,
        "seed": SEED,
        "optimizer": "AdamW at the workload's lr",
        "matmul_tf32": tf32_matmul(),
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "quick_skipped": f"torch.compile on the CPU; steps and blocks ({s.steps} x {s.rounds}); "
        f"the CPU batch ({s.cpu_batch} instead of the workload's)"
        if quick
        else None,
    }


def plot(result: BenchResult, path: Path) -> None:
    """Speed-up over fp32 per variant, one bar per device and workload, with its value."""
    import numpy as np

    rows = result.rows
    names = list(dict.fromkeys(r["variant"] for r in rows))
    groups = list(dict.fromkeys((r["device"], r["workload"]) for r in rows))
    x = np.arange(len(names))
    width = 0.8 / max(len(groups), 1)
    title = "Training speed-up over fp32 per precision variant"
    with figure(path, title, "variant", "speed-up over fp32 (x, higher is faster)") as ax:
        for i, (dev, workload) in enumerate(groups):
            mine = {
                r["variant"]: r for r in rows if (r["device"], r["workload"]) == (dev, workload)
            }
            offsets = x + (i - (len(groups) - 1) / 2) * width
            shown = [
                (o, mine[n]["speedup"])
                for o, n in zip(offsets, names, strict=True)
                if n in mine and mine[n].get("speedup")
            ]
            if shown:
                bars = ax.bar(*zip(*shown, strict=True), width, label=f"{workload} on {dev}")
                bar_labels(ax, bars, "{:.2f}")
            for o, n in zip(offsets, names, strict=True):
                if n in mine and not mine[n].get("speedup"):
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
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks(x, names, rotation=20, ha="right")
