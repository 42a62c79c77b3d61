"""``trace``: what ``gk.trace()`` costs on a real training loop.

Two kinds of loop, as people trace them:

- a built-in workload (default ``gpt``, the character-level transformer: hundreds of small ops
  per step, where a per-op hook costs the most) in ``gpukit train``'s loop: AdamW,
  ``rt.train_step`` and ``rt.log`` on one device, with the Runtime settings ``gpukit train``
  uses by default (read from its parser: see :mod:`gpukit.bench.train_defaults`);
- ``nanogpt``: a script's loop in nanoGPT's habits (:mod:`gpukit.bench.nanogpt_loop`): batches
  cut from a ``np.memmap`` at ``torch.randint`` offsets, a hand-set learning rate, gradient
  clipping, ``loss.item()`` every few iterations and a periodic evaluation.

The same model and optimizer run the variants, alternately:

- ``untraced``: the loop as it is;
- ``traced``: the same steps inside ``with gk.trace():`` (copies, syncs, ops per device);
- ``gpukit trace``: the same steps as ``gpukit trace`` runs a script: inside ``gk.trace()``
  and a placement log that counts per module (``log_placement(level="module")``).

Method (see :mod:`gpukit.bench.timing`): ``steps`` warm-up steps of each variant untimed; then
``rounds`` rounds, each timing ``steps`` steps of each variant (order alternating between
rounds), the garbage collector run before each timed block and off during it; on a GPU the
device is synchronised before each clock read. Reported: the median seconds per step of each,
and each traced variant's ratio to ``untraced`` as the median of the per-round ratios (each
compares timings taken moments apart, so slow drifts of the machine cancel out).

>>> result = run_trace_cost(workload="mlp", steps=2, rounds=1)
>>> [v["name"] for v in result["variants"]], result["loop"]
(['untraced', 'traced', 'gpukit trace'], 'gpukit train')
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from gpukit._util.text import make_table
from gpukit.bench.environment import environment
from gpukit.bench.nanogpt_loop import NanoGPTConfig, nanogpt_loop
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import check_count, synchronizer, time_rounds
from gpukit.bench.train_defaults import runtime_settings
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import load_workload

NANOGPT = "nanogpt"  # the workload name of the nanoGPT-style script's loop
TITLE = "what gk.trace() and gpukit trace cost on a training loop (traced / untraced)"
CLI = "gpukit trace"  # the variant run as the command runs a script: trace and placement log
# The suite's loops: gpukit train's on the gpt workload, and a script's in nanoGPT's habits.
SUITE_WORKLOADS = ("gpt", NANOGPT)
FULL, QUICK = (20, 7), (4, 3)  # (steps per round, rounds)


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
    ``rounds`` times; a JSON-ready dict with the environment, the variants and their ratios
    (``ratio``: traced, ``cli_ratio``: as ``gpukit trace`` runs it)."""
    check_count("steps", steps)
    check_count("rounds", rounds)
    check_workload(workload)
    from gpukit.diagnostics.oplog import log_placement
    from gpukit.diagnostics.trace import trace

    with contextlib.ExitStack() as stack:
        if workload == NANOGPT:
            step: Any = stack.enter_context(nanogpt_loop(nanogpt))
        else:
            step = _training_step(workload)

        def traced() -> None:
            with trace():
                step(steps)

        def as_cli() -> None:
            with trace(), log_placement(level="module"):
                step(steps)

        # Warm-up (one run of each) covers lazy initialisation, optimizer state, allocator
        # caches and the trace's own first-use costs.
        timings = time_rounds(
            {"untraced": lambda: step(steps), "traced": traced, CLI: as_cli},
            rounds,
            per=steps,
            synchronize=synchronizer(step.device),
        )
    ratios = timings.ratios("traced", "untraced")
    cli_ratios = timings.ratios(CLI, "untraced")
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
        "cli_ratio": timings.ratio(CLI, "untraced"),
        "cli_ratio_range": [min(cli_ratios), max(cli_ratios)],
    }


def table(result: dict[str, Any]) -> Table:
    """The result as a table: ms per step of each variant, and its ratio to untraced (the
    median of the per-round ratios) with its range over the rounds."""
    rows = []
    for variant in result["variants"]:
        low, high, ratio = _ratios(result, variant["name"])
        per_round = "" if variant["name"] == "untraced" else f"{low:.3f}-{high:.3f}"
        rows.append(
            [variant["name"], f"{variant['seconds_per_step'] * 1e3:.2f}", f"{ratio:.3f}", per_round]
        )
    title = (
        f"Cost of gk.trace() and gpukit trace: {result['workload']}, {result['steps']} steps x "
        f"{result['rounds']} rounds, {result['environment']['device']}"
    )
    return make_table(title, ["variant", "ms/step (median)", "x untraced", "per round"], rows)


def _ratios(result: dict[str, Any], name: str) -> tuple[float | None, float | None, float]:
    """(lowest, highest, median) ratio of variant ``name`` to untraced."""
    if name == "untraced":
        return None, None, 1.0
    prefix = "cli_" if name == CLI else ""
    low, high = result.get(f"{prefix}ratio_range", (None, None))
    return low, high, result[f"{prefix}ratio"]


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


def run(
    quick: bool = False,
    devices: Sequence[torch.device] | None = None,
    workloads: Sequence[str] = SUITE_WORKLOADS,
    steps: int | None = None,
    rounds: int | None = None,
) -> BenchResult:
    """The suite's entry point: :func:`run_trace_cost` for each of ``workloads`` on the device
    ``gpukit train`` would pick (``devices`` is not used: the loop picks its own), as one
    :class:`BenchResult`.

    >>> r = run(workloads=("mlp",), steps=2, rounds=1)
    >>> [row["variant"] for row in r.rows]
    ['untraced', 'traced', 'gpukit trace']
    """
    default_steps, default_rounds = QUICK if quick else FULL
    for name in workloads:
        check_workload(name)
    results = [
        run_trace_cost(name, steps=steps or default_steps, rounds=rounds or default_rounds)
        for name in workloads
    ]
    return as_result(results, quick)


def as_result(results: Sequence[dict[str, Any]], quick: bool = False) -> BenchResult:
    """One or more :func:`run_trace_cost` results in the suite's form: a row per workload and
    variant."""
    rows = []
    for result in results:
        for variant in result["variants"]:
            low, high, ratio = _ratios(result, variant["name"])
            rows.append(
                {
                    "workload": result["workload"],
                    "loop": result["loop"],
                    "device": result["environment"]["device"],
                    "variant": variant["name"],
                    "ms_per_step": variant["seconds_per_step"] * 1e3,
                    "ratio": ratio,
                    "low": low,
                    "high": high,
                }
            )
    first = results[0]
    return BenchResult(
        experiment="trace",
        title=(
            f"trace: cost of gk.trace() and gpukit trace, {first['steps']} steps x "
            f"{first['rounds']} rounds"
        ),
        keys=("workload", "variant"),
        columns=(
            Column("workload"),
            Column("loop"),
            Column("device"),
            Column("variant"),
            Column("ms_per_step", "time per step", "ms", 2),
            Column("ratio", "× untraced", "", 3),
            Column("low", "lowest", "", 3, compare=False),
            Column("high", "highest", "", 3, compare=False),
        ),
        rows=rows,
        summary={
            f"{r['workload']}: {name} x untraced": _ratios(r, name)[2]
            for r in results
            for name in ("traced", CLI)
            if name == "traced" or "cli_ratio" in r
        },
        notes=[
            "× untraced: median of the per-round ratios; lowest/highest: their range",
            "the limit: 1.000; every op goes through the trace's dispatch mode, so the cost "
            "grows with the ops per step, not with their size",
            "gpukit trace: the trace and a placement log counting per module, as the command "
            "runs a script (one dispatch pass serves both)",
        ],
        parameters={
            "steps": first["steps"],
            "rounds": first["rounds"],
            "workloads": [r["workload"] for r in results],
            "quick": quick,
        },
        environment=first["environment"],
        raw={"results": list(results)},
    )


def plot(result: BenchResult, path: Path) -> None:
    """Time per step of each variant, per workload, with the ratio on the traced bars."""
    from gpukit.bench.plotting import bar_labels, figure

    workloads = list(dict.fromkeys(r["workload"] for r in result.rows))
    by = {(r["workload"], r["variant"]): r for r in result.rows}
    with figure(
        path,
        "Cost of gk.trace() per training step",
        "training loop",
        "time per step (ms, median of the rounds)",
    ) as ax:
        variants = list(dict.fromkeys(r["variant"] for r in result.rows))
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            xs = [w + (i - (len(variants) - 1) / 2) * width for w in range(len(workloads))]
            ys = [by[(w, variant)]["ms_per_step"] for w in workloads]
            bars = ax.bar(xs, ys, width, label=variant)
            if variant != "untraced":
                ratios = [by[(w, variant)]["ratio"] for w in workloads]
                for bar, ratio in zip(bars, ratios, strict=True):
                    ax.annotate(
                        f"x{ratio:.2f}",
                        (bar.get_x() + width / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=8,
                    )
            else:
                bar_labels(ax, bars, "{:.1f}")
        ax.set_xticks(range(len(workloads)), workloads)
