"""``save``: how long does a checkpoint stop training, written in the background or not?

A stack of ``LAYERS`` square linear layers (AdamW, float32; ``WIDTH`` wide, ``QUICK_WIDTH``
with ``--quick``) is trained through ``gk.Runtime(checkpoints=...)`` on each device, whole
(``single``) and sharded by fsdp over a process group of one in this process (``fsdp``: every
rank's shards through torch.distributed.checkpoint, and the exported full weights); between
two steps ``rt.save()`` is timed, the stall the training loop sees, once with
``async_save=False`` (the files written, fsynced and published before it returns) and once
with ``async_save=True`` (the collective part and the copy to host memory; a thread writes).
Each round times one save of each, in an order rotated each round, with the previous
background write finished first (``latest`` naming it), so that a stall never includes waiting
for another save; the background write's own time, until ``latest`` names it, is reported
beside it. Per device: the median of each, and ``stall_ratio``, the median over the rounds of
the async stall over the synchronous save of the same round. The goal: at most
:data:`GOAL` (a tenth of a synchronous save).

>>> r = run(quick=True, devices=[torch.device("cpu")], rounds=1)
>>> [(row["device"], row["strategy"], row["mode"]) for row in r.rows][:2]
[('cpu', 'single', 'sync'), ('cpu', 'single', 'async')]
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.bench.environment import environment_of
from gpukit.bench.measure import check_devices
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import check_count
from gpukit.checkpoint import files

TITLE = "save: the stall of a checkpoint written in the background vs a synchronous one"
LAYERS = 4
WIDTH, QUICK_WIDTH = 1024, 256  # 4 x 1024^2 fp32: 16 MiB of weights, 48 MiB with AdamW
ROUNDS, QUICK_ROUNDS = 7, 3
GOAL = 0.10  # the background save's stall over a synchronous save's, at most
MODES = ("sync", "async")
STRATEGIES = ("single", "fsdp")
_WRITE_WAIT_S = 600.0  # a background write that takes longer than this is reported as failed

COLUMNS = (
    Column("device"),
    Column("strategy"),
    Column("mode"),
    Column("mib", "checkpoint", "MiB", 1, compare=False),
    Column("stall_ms", "training stalled", "ms", 2),
    Column("write_ms", "until published", "ms", 2),
    Column("stall_ratio", "stall / sync save", "", 3),
)


def run(
    quick: bool = False,
    devices: Sequence[torch.device] | None = None,
    rounds: int | None = None,
) -> BenchResult:
    """Time synchronous and background saves on every device (default: the CPU and every
    GPU), of a whole model and of one sharded by fsdp; ``rounds`` saves of each."""
    devs = check_devices(devices, "save")
    rounds = rounds if rounds is not None else (QUICK_ROUNDS if quick else ROUNDS)
    check_count("rounds", rounds, "saves of each kind timed per device")
    width = QUICK_WIDTH if quick else WIDTH
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for dev, strategy in [(d, s) for d in devs for s in STRATEGIES]:
        with tempfile.TemporaryDirectory(prefix="gpukit-bench-save-") as tmp:
            stalls, writes, mib = _time_saves(dev, strategy, width, rounds, Path(tmp))
        ratios = [a / s for a, s in zip(stalls["async"], stalls["sync"], strict=True)]
        label = str(dev) if strategy == "single" else f"{dev} {strategy}"
        raw[label] = {"stall_s": stalls, "write_s": writes, "ratios": ratios}
        ratio = statistics.median(ratios)
        for mode in MODES:
            rows.append(
                {
                    "device": str(dev),
                    "strategy": strategy,
                    "mode": mode,
                    "mib": mib,
                    "stall_ms": statistics.median(stalls[mode]) * 1e3,
                    "write_ms": statistics.median(writes[mode]) * 1e3,
                    "stall_ratio": ratio if mode == "async" else 1.0,
                }
            )
        summary[f"{label}: async stall / sync save"] = ratio
        summary[f"{label}: goal met (<= {GOAL})"] = ratio <= GOAL
    return BenchResult(
        experiment="save",
        title=f"{TITLE} ({LAYERS} x {width}^2 float32, AdamW)",
        keys=("device", "strategy", "mode"),
        columns=COLUMNS,
        rows=rows,
        summary=summary,
        notes=_notes(),
        parameters={
            "quick": quick,
            "layers": LAYERS,
            "width": width,
            "rounds": rounds,
            "dtype": "float32",
            "goal": GOAL,
        },
        environment=environment_of(devs),
        raw=raw,
    )


def _time_saves(
    dev: torch.device, strategy: str, width: int, rounds: int, folder: Path
) -> tuple[dict[str, list[float]], dict[str, list[float]], float]:
    """Per mode, each round's stall and time until published (seconds), and the checkpoint's
    size (MiB). Under fsdp the first Runtime makes the process group of one that the second
    joins, and leaves it at its teardown."""
    import gpukit as gk

    runs: dict[str, Any] = {}
    for mode in MODES:
        rt = gk.Runtime(
            strategy=strategy,
            devices=[str(dev)],
            seed=0,
            checkpoints=folder / mode,
            keep=2,
            async_save=mode == "async",
        )
        net = nn.Sequential(*(nn.Linear(width, width) for _ in range(LAYERS)))
        # fsdp prints its plan once per process: not this experiment's output (and a doctest's
        # output would depend on what ran before it in the process).
        with contextlib.redirect_stdout(io.StringIO()):
            model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters()))
        runs[mode] = (rt, model, optimizer)
    stalls: dict[str, list[float]] = {m: [] for m in MODES}
    writes: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for round_ in range(rounds + 1):  # the first round warms up, untimed
            order = MODES if round_ % 2 else MODES[::-1]
            for mode in order:
                rt, model, optimizer = runs[mode]
                rt.backward(model(torch.ones(8, width, device=rt.device)).square().mean())
                rt.step(optimizer)
                _sync(dev)
                began = time.perf_counter()
                path = rt.save()
                stalled = time.perf_counter() - began
                _published(folder / mode, path.name)
                written = time.perf_counter() - began
                rt.wait_for_save()  # its pruning too: the next stall waits for nothing
                if round_:
                    stalls[mode].append(stalled)
                    writes[mode].append(written)
        mib = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
    finally:
        for rt, _, _ in reversed(runs.values()):  # the group's maker last (see above)
            rt.teardown()
    return stalls, writes, mib


def _published(folder: Path, name: str) -> None:
    """Wait until ``latest`` names ``name``: the checkpoint is published (the time a
    background write takes, which ``rt.wait_for_save`` would count with its pruning)."""
    deadline = time.monotonic() + _WRITE_WAIT_S
    pointer = folder / files.LATEST
    while not (pointer.is_file() and pointer.read_text().strip() == name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the checkpoint {name} was not published within {_WRITE_WAIT_S} s")
        time.sleep(0.001)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _notes() -> list[str]:
    return [
        "training stalled: how long rt.save() kept the loop from its next step. sync: the "
        "whole save (write, fsync, manifest, rename, latest, prune). async: the collective "
        "part and the copy to host memory, into the previous save's (pinned on a GPU; the "
        "finiteness check runs on the writing thread); under fsdp also the gathers of the "
        "exported full weights, which need the training group.",
        "until published: from the call until 'latest' names the new checkpoint (the same as "
        "the stall for sync). stall / sync save: the median over the rounds of the async "
        f"stall over the same round's synchronous save; the goal is at most {GOAL}.",
        "The disk decides the synchronous save: a fast local SSD makes it short and the ratio "
        "larger; a network file system makes it long and the ratio small.",
    ]


def plot(result: BenchResult, path: Path) -> None:
    """Bars: each device and strategy's stall per mode, with the ratio on the async bar."""
    from gpukit.bench.plotting import figure

    groups = list(dict.fromkeys((r["device"], r.get("strategy", "single")) for r in result.rows))
    by_key = {(r["device"], r.get("strategy", "single"), r["mode"]): r for r in result.rows}
    with figure(path, "The stall of one checkpoint save", "device", "stall (ms)") as ax:
        for i, mode in enumerate(MODES):
            xs = [g + (i - 0.5) * 0.4 for g in range(len(groups))]
            heights = [by_key[(group[0], group[1], mode)]["stall_ms"] for group in groups]
            bars = ax.bar(xs, heights, 0.4, label=mode)
            labels = [
                f"{by_key[(group[0], group[1], mode)]['stall_ratio']:.3f}x" for group in groups
            ]
            ax.bar_label(bars, labels, fontsize=7)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{dev} {strategy}" for dev, strategy in groups])
