"""``sync``: what does reading the loss back every step cost?

A loop of ``STEPS`` products of 100×100 float32 matrices, ``x = x @ w`` then ``x = x / ‖x‖``
(a real loop keeps its values bounded too), logs ``‖x‖`` in one of four ways:

- ``device-log``: adds it to a tensor on the device and reads that back once, after the loop
  (one synchronisation per loop);
- ``item-every-10``: the same, and reads the running sum back every 10th step;
- ``item``: ``total += norm.item()`` every step;
- ``print``: the device-log loop that also prints the norm every step (``str()`` of a tensor
  reads it back), into memory: the terminal's own cost is not part of the lesson.

Every variant returns the sum of the norms, so they can be checked against each other.

Method (see :mod:`gpukit.bench.measure`): each full loop is one timed call, with the host
clock between synchronisations of the device (the host waits by design here), after warm-up
loops, repeated, each repeat starting from the next of ``POOL`` starting matrices. The cost of
one synchronisation is the extra time over device-log divided by the extra read-backs. The
CPU runs them with one intra-op thread (:data:`CPU_THREADS`).

>>> loop("item", torch.eye(4), torch.eye(4), steps=3) == loop("device-log", torch.eye(4),
...     torch.eye(4), steps=3)
True
>>> syncs_per_loop("item-every-10", 1000), syncs_per_loop("print", 1000)
(100, 1001)
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.measure import Stats, check_devices, measure
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import check_count, torch_threads
from gpukit.errors import ConfigError

TITLE = "sync: what reading a value back every step costs (.item(), print) vs one read per loop"

SIZE = 100  # the matrices' side: small, so that one step is dominated by waiting, not work
STEPS = 1000
QUICK_STEPS = 200
EVERY = 10  # item-every-10 reads back every this many steps
POOL = 4  # starting matrices the repeats rotate through
# A 100×100 product gains nothing from more threads on the CPU, and on a busy machine each op's
# threads would wait for one another (milliseconds per step instead of microseconds).
CPU_THREADS = 1
SEED = 0
VARIANTS = ("device-log", "item-every-10", "item", "print")

COLUMNS = (
    Column("device"),
    Column("variant"),
    Column("syncs", "syncs per loop", compare=False),
    Column("loop_ms", "time per loop", "ms", 2),
    Column("step_us", "time per step", "µs", 2),
    Column("ratio", "× device-log", "", 2),
    Column("sync_us", "cost per sync", "µs", 2),
)


def syncs_per_loop(variant: str, steps: int) -> int:
    """The read-backs one loop of ``variant`` makes: what ``gk.trace()`` counts on it.

    >>> [syncs_per_loop(v, 25) for v in VARIANTS]
    [1, 3, 25, 26]
    """
    check_variant(variant)
    check_count("steps", steps, "steps per loop")
    if variant == "device-log":
        return 1
    if variant == "item-every-10":
        return -(-steps // EVERY)  # every 10th step, and the last one when it is not
    if variant == "item":
        return steps
    return steps + 1  # a print per step, and device-log's read at the end


def loop(variant: str, x: torch.Tensor, w: torch.Tensor, steps: int = STEPS) -> float:
    """Run ``steps`` steps from ``x`` on ``x``'s device, logging the norm as ``variant`` does;
    the sum of the norms.

    >>> loop("print", torch.ones(1, 1), torch.full((1, 1), 2.0), steps=4)
    8.0
    """
    check_variant(variant)
    check_count("steps", steps, "steps per loop")
    if variant == "item":
        total = 0.0
        for _ in range(steps):
            x = x @ w
            norm = torch.linalg.vector_norm(x)
            x = x / norm
            total += norm.item()  # waits for this step's kernels, every step
        return total
    # Preallocated: the sum stays on the device, the host queues steps without waiting.
    logged = torch.zeros((), dtype=x.dtype, device=x.device)
    sink = io.StringIO() if variant == "print" else None
    for i in range(steps):
        x = x @ w
        norm = torch.linalg.vector_norm(x)
        x = x / norm
        logged.add_(norm)
        if sink is not None:
            print("step", i, "norm", norm, file=sink)  # str(norm) reads it back
        elif variant == "item-every-10" and (i + 1) % EVERY == 0 and i + 1 < steps:
            logged.item()  # as a logger that shows the running sum every 10 steps
    return logged.item()


def check_variant(variant: str) -> None:
    """ConfigError unless ``variant`` is one of :data:`VARIANTS`.

    >>> check_variant("items")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: variant 'items': the sync experiment has device-log, ...
    """
    if variant not in VARIANTS:
        raise ConfigError(f"variant {variant!r}: the sync experiment has {', '.join(VARIANTS)}")


def inputs(device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The starting matrices the repeats rotate through and the matrix ``w``, on ``device``:
    drawn on the CPU from a fixed seed, so every device runs the same numbers.

    >>> starts, w = inputs(torch.device("cpu"))
    >>> len(starts), tuple(w.shape)
    (4, (100, 100))
    """
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(SIZE, SIZE, generator=gen) / SIZE**0.5  # norm-preserving on average
    starts = [torch.randn(SIZE, SIZE, generator=gen) for _ in range(POOL)]
    return [s.to(device) for s in starts], w.to(device)


def run(quick: bool = False, devices: Sequence[torch.device] | None = None) -> BenchResult:
    """Time every variant's loop on every device (default: the CPU and every GPU).

    >>> r = run(quick=True, devices=[torch.device("cpu")])
    >>> [(row["variant"], row["syncs"]) for row in r.rows]
    [('device-log', 1), ('item-every-10', 20), ('item', 200), ('print', 201)]
    """
    devs = check_devices(devices, "sync")
    steps = QUICK_STEPS if quick else STEPS
    repeats, budget_s, warmup = (7, 0.5, 1) if quick else (20, 2.0, 2)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for dev in devs:
        starts, w = inputs(dev)
        timed: dict[str, Stats] = {}
        with _on(dev):
            for variant in VARIANTS:
                timed[variant] = measure(
                    _work(variant, w, steps),
                    dev,
                    inputs=starts,
                    repeats=repeats,
                    warmup=warmup,
                    budget_s=budget_s,
                    clock="host",
                )
        base = timed["device-log"].median
        raw[str(dev)] = {v: s.to_dict() for v, s in timed.items()}
        for variant, s in timed.items():
            syncs = syncs_per_loop(variant, steps)
            extra = syncs - syncs_per_loop("device-log", steps)
            rows.append(
                {
                    "device": str(dev),
                    "variant": variant,
                    "syncs": syncs,
                    "loop_ms": s.median * 1e3,
                    "step_us": s.median / steps * 1e6,
                    "ratio": s.median / base,
                    "sync_us": (s.median - base) / extra * 1e6 if extra else None,
                }
            )
        summary[f"{dev}: item / device-log"] = timed["item"].median / base
        extra_item = syncs_per_loop("item", steps) - 1
        summary[f"{dev}: cost per sync (µs)"] = (timed["item"].median - base) / extra_item * 1e6
    return BenchResult(
        experiment="sync",
        title=f"{TITLE} ({steps} steps of {SIZE}×{SIZE} float32)",
        keys=("device", "variant"),
        columns=COLUMNS,
        rows=rows,
        summary=summary,
        notes=_notes(steps),
        parameters={
            "quick": quick,
            "size": SIZE,
            "steps": steps,
            "dtype": "float32",
            "every": EVERY,
            "pool": POOL,
            "seed": SEED,
            "clock": "host",
            "cpu_threads": CPU_THREADS,
            "repeats": repeats,
            "budget_s": budget_s,
            "warmup": warmup,
        },
        environment=environment_of(devs),
        raw=raw,
    )


def _notes(steps: int) -> list[str]:
    return [
        f"Each loop: {steps} steps of x = x @ w; x = x / ‖x‖. ratio: median time per loop over "
        "device-log's, same device, same run. cost per sync = (time - device-log's time) / "
        "(syncs - 1): what each extra read-back adds.",
        "CPU (one intra-op thread): an op has finished when it returns, so a read-back waits "
        "for nothing: item stays near 1.0× device-log and its cost per sync near 0 (below 0 "
        "when the read costs less than the add on the device it replaces). That is the lesson, "
        "not a failure. print's extra cost there is turning a tensor into text.",
        "GPU: the host queues kernels ahead of the GPU; a read-back drains that queue, then "
        "the GPU idles until the host queues the next step. Compare the cost per sync with one "
        "host-GPU round trip (kernel launch plus completion, about 10-50 µs).",
        "print on a GPU: str() of a CUDA tensor runs several small kernels and waits on "
        "several of them, so one print costs more than one .item(); f'{loss:.4f}' reads once.",
    ]


def _work(variant: str, w: torch.Tensor, steps: int) -> Callable[[torch.Tensor], float]:
    return lambda x: loop(variant, x, w, steps)


def _on(dev: torch.device) -> contextlib.AbstractContextManager[Any]:
    """What the loops on ``dev`` run under: a GPU made the current device; on the CPU, one
    intra-op thread (:data:`CPU_THREADS`)."""
    if dev.type == "cuda":
        return torch.cuda.device(dev)
    return torch_threads(CPU_THREADS) if dev.type == "cpu" else contextlib.nullcontext()


def plot(result: BenchResult, path: Path) -> None:
    """Grouped bars: time per step of every variant, per device, with the value on each."""
    devices = list(dict.fromkeys(r["device"] for r in result.rows))
    variants = list(dict.fromkeys(r["variant"] for r in result.rows))
    by_key = {(r["device"], r["variant"]): r for r in result.rows}
    width = 0.8 / max(len(variants), 1)
    steps = result.parameters.get("steps", "?")
    title = f"Reading a value back every step: {steps} steps of {SIZE}×{SIZE} products"
    size = (max(7.5, 1.0 + 2.2 * len(devices)), 4.5)  # room for four labelled bars per device
    with figure(path, title, "device", "time per step (µs)", size=size) as ax:
        for i, variant in enumerate(variants):
            xs = [d + (i - (len(variants) - 1) / 2) * width for d in range(len(devices))]
            heights = [by_key.get((dev, variant), {}).get("step_us", 0.0) for dev in devices]
            bars = ax.bar(xs, heights, width, label=variant)
            ratios = [by_key.get((dev, variant), {}).get("ratio") for dev in devices]
            ax.bar_label(
                bars, [_bar_text(h, r) for h, r in zip(heights, ratios, strict=True)], fontsize=7
            )
        ax.set_xticks(range(len(devices)))
        ax.set_xticklabels([_label(result, dev) for dev in devices])
        ax.margins(y=0.12)  # room for the labels above the tallest bars


def _bar_text(step_us: float, ratio: float | None) -> str:
    """A bar's label: its height, and its ratio to device-log when known.

    >>> _bar_text(18.04, 3.5)
    '18.0 µs\\n3.50×'
    """
    return f"{step_us:.1f} µs" + (f"\n{ratio:.2f}×" if ratio is not None else "")


def _label(result: BenchResult, device: str) -> str:
    """The device and its name, as the result's environment recorded them."""
    for entry in result.environment.get("devices", []):
        if entry.get("device") == device and entry.get("name") and device != "cpu":
            return f"{device}\n{entry['name']}"
    return device
