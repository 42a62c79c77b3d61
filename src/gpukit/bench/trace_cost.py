"""``trace``: what ``gk.trace()`` costs on a real training loop.

The loop is ``gpukit train``'s: a built-in workload (default ``gpt``, the character-level
transformer: hundreds of small ops per step, where a per-op hook costs the most), AdamW,
``rt.train_step`` and ``rt.log`` on one device. The same model and optimizer run both variants,
alternately:

- ``untraced``: the loop as ``gpukit train`` runs it;
- ``traced``: the same steps inside ``with gk.trace():`` (copies, syncs, ops per device).

Method: warm-up steps untimed; then ``rounds`` rounds, each timing ``steps`` steps of each
variant (order alternating between rounds), the garbage collector run before each timed block
and off during it; on a GPU the device is synchronised before each clock read. Reported: the
median seconds per step of each, and the ratio as the median of the per-round ratios (each
compares timings taken moments apart, so slow drifts of the machine cancel out).

>>> result = run_trace_cost(workload="mlp", steps=2, rounds=1)
>>> [v["name"] for v in result["variants"]]
['untraced', 'traced']
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from rich.table import Table

from gpukit._util.text import make_table
from gpukit.bench.environment import environment
from gpukit.errors import ConfigError
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import load_workload


def run_trace_cost(workload: str = "gpt", steps: int = 20, rounds: int = 5) -> dict[str, Any]:
    """Time ``steps`` training steps of ``workload`` with and without the trace, ``rounds``
    times; a JSON-ready dict with the environment, both variants and the ratio."""
    for name, value in (("steps", steps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
    from gpukit.diagnostics.trace.core import trace

    step = _training_step(workload)
    step(steps)  # warm-up: lazy initialisation, optimizer state, allocator caches
    with trace():
        step(2)
    times: dict[str, list[float]] = {"untraced": [], "traced": []}
    for r in range(rounds):
        order = ["untraced", "traced"] if r % 2 == 0 else ["traced", "untraced"]
        for variant in order:
            times[variant].append(_timed(step, steps, traced=variant == "traced", trace=trace))
    ratios = [t / u for t, u in zip(times["traced"], times["untraced"], strict=True)]
    device = str(step.device)
    return {
        "experiment": "trace",
        "environment": environment(device=device),
        "workload": workload,
        "steps": steps,
        "rounds": rounds,
        "variants": [
            {"name": n, "seconds_per_step": statistics.median(ts), "rounds": ts}
            for n, ts in times.items()
        ],
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def table(result: dict[str, Any]) -> Table:
    """The result as a table: ms per step of each variant, and the traced/untraced ratio (the
    median of the per-round ratios) with its range over the rounds."""
    low, high = result["ratio_range"]
    untraced, traced = result["variants"]
    rows = [
        ["untraced", f"{untraced['seconds_per_step'] * 1e3:.2f}", "1.000", ""],
        [
            "traced",
            f"{traced['seconds_per_step'] * 1e3:.2f}",
            f"{result['ratio']:.3f}",
            f"{low:.3f}-{high:.3f}",
        ],
    ]
    title = (
        f"Cost of gk.trace(): {result['workload']}, {result['steps']} steps x "
        f"{result['rounds']} rounds, {result['environment']['device']}"
    )
    return make_table(title, ["variant", "ms/step (median)", "x untraced", "per round"], rows)


def _training_step(workload: str) -> Any:
    """A callable running N optimizer steps of ``workload`` as gpukit train does."""
    spec = load_workload(workload, seed=0)
    rt = Runtime(seed=0, log_every=10)
    model = spec.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    loader = torch.utils.data.DataLoader(
        spec.dataset, batch_size=spec.batch_size, shuffle=True, drop_last=True
    )
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    criterion = rt.setup_criterion(spec.loss)
    batches = _forever(loader)

    def compute_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    def run(n: int) -> None:
        for _ in range(n):
            rt.log(loss=rt.train_step(optimizer, next(batches), compute_loss))

    run.device = rt.device.torch  # type: ignore[attr-defined]
    return run


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _timed(step: Callable[[int], None], steps: int, traced: bool, trace: Any) -> float:
    device = step.device  # type: ignore[attr-defined]
    gc.collect()
    gc.disable()
    try:
        _synchronize(device)
        start = time.perf_counter()
        if traced:
            with trace():
                step(steps)
        else:
            step(steps)
        _synchronize(device)
        return (time.perf_counter() - start) / steps
    finally:
        gc.enable()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
