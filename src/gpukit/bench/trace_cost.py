"""``trace``: what ``gk.trace()`` costs on a real training loop.

Two kinds of loop, as people trace them:

- a built-in workload (default ``gpt``, the character-level transformer: hundreds of small ops
  per step, where a per-op hook costs the most) in ``gpukit train``'s loop: AdamW,
  ``rt.train_step`` and ``rt.log`` on one device, with the Runtime settings ``gpukit train``
  uses by default (read from its parser: see :mod:`gpukit.bench.train_defaults`);
- ``nanogpt``: a script's loop in nanoGPT's habits (:mod:`gpukit.bench.nanogpt_loop`): batches
  cut from a ``np.memmap`` at ``torch.randint`` offsets, a hand-set learning rate, gradient
  clipping, ``loss.item()`` every few iterations and a periodic evaluation.

The same model and optimizer run both variants, alternately:

- ``untraced``: the loop as it is;
- ``traced``: the same steps inside ``with gk.trace():`` (copies, syncs, ops per device).

Method (see :mod:`gpukit.bench.timing`): ``steps`` warm-up steps of each variant untimed; then
``rounds`` rounds, each timing ``steps`` steps of each variant (order alternating between
rounds), the garbage collector run before each timed block and off during it; on a GPU the
device is synchronised before each clock read. Reported: the median seconds per step of each,
and the ratio as the median of the per-round ratios (each compares timings taken moments apart,
so slow drifts of the machine cancel out).

>>> result = run_trace_cost(workload="mlp", steps=2, rounds=1)
>>> [v["name"] for v in result["variants"]], result["loop"]
(['untraced', 'traced'], 'gpukit train')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from rich.table import Table

from gpukit._util.text import make_table
from gpukit.bench.environment import environment
from gpukit.bench.nanogpt_loop import NanoGPTConfig, nanogpt_loop
from gpukit.bench.timing import check_count, synchronizer, time_rounds
from gpukit.bench.train_defaults import runtime_settings
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import load_workload

NANOGPT = "nanogpt"  # the workload name of the nanoGPT-style script's loop


def check_workload(workload: str) -> None:
    """Fail now, not after a warm-up, on a name that is neither ``nanogpt`` nor a workload
    ``gpukit train`` runs (a built-in one, or ``module:function``)."""
    if workload != NANOGPT:
        load_workload(workload)


def run_trace_cost(
    workload: str = "gpt",
    steps: int = 20,
    rounds: int = 5,
    *,
    nanogpt: NanoGPTConfig | None = None,
) -> dict[str, Any]:
    """Time ``steps`` training steps of ``workload`` (``nanogpt``: the nanoGPT-style loop,
    with the settings ``nanogpt``, by default its CPU sizes) with and without the trace,
    ``rounds`` times; a JSON-ready dict with the environment, both variants and the ratio."""
    check_count("steps", steps)
    check_count("rounds", rounds)
    check_workload(workload)
    from gpukit.diagnostics.trace import trace

    with contextlib.ExitStack() as stack:
        if workload == NANOGPT:
            step: Any = stack.enter_context(nanogpt_loop(nanogpt))
        else:
            step = _training_step(workload)

        def traced() -> None:
            with trace():
                step(steps)

        # Warm-up (one run of each) covers lazy initialisation, optimizer state, allocator
        # caches and the trace's own first-use costs.
        timings = time_rounds(
            {"untraced": lambda: step(steps), "traced": traced},
            rounds,
            per=steps,
            synchronize=synchronizer(step.device),
        )
    ratios = timings.ratios("traced", "untraced")
    device = str(step.device)
    return {
        "experiment": "trace",
        "environment": environment(device=device),
        "workload": workload,
        "loop": "nanoGPT-style script" if workload == NANOGPT else "gpukit train",
        "steps": steps,
        "rounds": rounds,
        "variants": [
            {"name": n, "seconds_per_step": timings.median(n), "rounds": list(ts)}
            for n, ts in timings.seconds.items()
        ],
        "ratio": timings.ratio("traced", "untraced"),
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
    settings = runtime_settings()  # gpukit train's, on the device it would pick
    spec = load_workload(workload, seed=settings["seed"])
    rt = Runtime(**settings)
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

    run.device = rt.device  # type: ignore[attr-defined]
    return run


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader
