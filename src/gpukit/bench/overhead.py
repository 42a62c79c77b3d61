"""``overhead``: what a training wrapper adds to the cost of every step.

The same tiny training loop (the built-in ``mlp`` workload's 32-64-64-4 MLP, AdamW, batch 64,
cross-entropy, float32; see :mod:`gpukit.bench.overhead_loops`) runs as

- ``plain``: PyTorch alone: forward, loss, ``backward``, ``step``, ``zero_grad(set_to_none=True)``;
- ``plain-logged``: the same, keeping the loss on the device and reading its mean back every
  ``--log-every`` steps of ``gpukit train``: the fair reference for a loop that logs;
- ``gpukit``: through ``Runtime(devices="cpu", precision="32")``: ``rt.backward``, ``rt.step``;
- ``gpukit-train-step``: one ``rt.train_step(optimizer, batch, compute_loss)`` per batch, with
  Runtime's default settings (``devices="cpu"``; precision "auto", which is 32 on the CPU);
- ``gpukit-train-default``: ``rt.train_step`` then ``rt.log(loss=loss)``, with the Runtime
  settings ``gpukit train`` uses by default (its ``--oom``, ``--log-every 10``, ``--seed 0``,
  read from its argument parser), on the CPU; compared with ``plain-logged`` too;
- ``gpukit+csv``, ``gpukit+tensorboard``: ``gpukit-train-default`` with ``loggers=["csv"]`` or
  ``["tensorboard"]`` (where installed), writing into a temporary folder at every read-back;
- ``accelerate``: through Hugging Face Accelerate (``Accelerator(cpu=True)``), where installed;
- ``fabric``: through Lightning Fabric (``Fabric(accelerator="cpu", devices=1)``), where installed.

Every variant starts from the same weights and iterates over the same list of batches already in
memory (no DataLoader), so only the wrapper differs. Each variant is built ``INSTANCES`` times
and the rounds take turns among them: one model's place in memory can make it a few percent
faster or slower than an identical one, and taking turns spreads that over the rounds instead
of giving it to one variant. A model this small makes the step as cheap
as it gets, which is where a wrapper's Python overhead shows the most.

Method (see :mod:`gpukit.bench.timing`): CPU only, one torch thread (restored afterwards): the
work is dispatch and Python, and more threads only add scheduling noise; nothing here may move
to a GPU, whose clock reads would need synchronising. Every variant first runs ``steps`` untimed
steps; then ``rounds`` rounds each time ``steps`` steps of every variant, in an order rotated
each round, the garbage collector off while timing. Per variant: the median seconds per step
over the rounds, and the ratio to plain (and to its own baseline, where that is another) as the
median of the per-round ratios.

>>> result = run_overhead(steps=2, rounds=1)
>>> [(v.name, v.available) for v in result.variants][:4]
[('plain', True), ('plain-logged', True), ('gpukit', True), ('gpukit-train-step', True)]
"""

from __future__ import annotations

import importlib
import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.table import Table
from torch import nn
from torch.optim import Optimizer

from gpukit import __version__
from gpukit.bench import overhead_loops as loops
from gpukit.bench.environment import environment
from gpukit.bench.result import BenchResult, Column
from gpukit.bench.timing import check_count, time_rounds, torch_threads
from gpukit.errors import ConfigError

TITLE = "what a training wrapper adds to every step (gpukit, Accelerate, Fabric vs plain PyTorch)"
# Steps per round and rounds: the full run's (gpukit bench overhead's defaults) and --quick's.
FULL, QUICK = (200, 15), (20, 5)

WORKLOAD = {
    "model": "mlp 32-64-64-4, ReLU",
    "optimizer": f"AdamW(lr={loops.LR})",
    "loss": "cross_entropy",
    "batch_size": loops.BATCH_SIZE,
    "dtype": "float32",
    "device": "cpu",
    "seed": loops.SEED,
    "data": "a list of batches built once, in memory",
}


# Copies of each variant, taking turns over the rounds (see the module docstring).
INSTANCES = 3


@dataclass(frozen=True)
class _Variant:
    name: str
    build: Callable[[nn.Module, Optimizer], loops.Loop]
    settings: Callable[[], dict[str, Any]]  # the wrapper's constructor arguments
    modules: tuple[str, ...] = ()  # one of these must import; () for the always-there ones
    version: str | None = None  # of the always-there ones; the others say at import
    baseline: str = "plain"  # the loop that does the same work without the wrapper


VARIANTS = (
    _Variant("plain", loops.plain_loop, dict, version=torch.__version__),
    _Variant(
        "plain-logged",
        loops.plain_logged_loop,
        lambda: {"log_every": loops.train_default()["log_every"]},
        version=torch.__version__,
    ),
    _Variant("gpukit", loops.gpukit_loop, lambda: dict(loops.GPUKIT), version=__version__),
    _Variant(
        "gpukit-train-step",
        loops.train_step_loop,
        lambda: dict(loops.TRAIN_STEP),
        version=__version__,
    ),
    _Variant(
        "gpukit-train-default",
        loops.train_default_loop,
        loops.train_default,
        version=__version__,
        baseline="plain-logged",
    ),
    _Variant(
        "gpukit+csv",
        loops.logger_loop("csv"),
        lambda: {**loops.train_default(), "loggers": "csv"},
        version=__version__,
        baseline="plain-logged",
    ),
    _Variant(
        "gpukit+tensorboard",
        loops.logger_loop("tensorboard"),
        lambda: {**loops.train_default(), "loggers": "tensorboard"},
        ("tensorboard",),
        baseline="plain-logged",
    ),
    _Variant("accelerate", loops.accelerate_loop, lambda: dict(loops.ACCELERATE), ("accelerate",)),
    _Variant("fabric", loops.fabric_loop, lambda: dict(loops.FABRIC), loops.FABRIC_MODULES),
)


@dataclass(frozen=True)
class VariantResult:
    """One variant's timings, per round; empty with a ``note`` when it could not run."""

    name: str
    version: str | None
    seconds: tuple[float, ...] = ()  # seconds per step, one per round
    ratios: tuple[float, ...] = ()  # these seconds / plain's in the same round
    note: str = ""  # "not installed", or why it failed
    settings: dict[str, Any] = field(default_factory=dict)  # what the wrapper was built with
    baseline: str = "plain"
    baseline_ratios: tuple[float, ...] = ()  # these seconds / the baseline's, per round

    @property
    def available(self) -> bool:
        return bool(self.seconds)

    @property
    def seconds_per_step(self) -> float | None:
        """Median over the rounds of the seconds per step."""
        return statistics.median(self.seconds) if self.seconds else None

    @property
    def ratio(self) -> float | None:
        """Median over the rounds of the ratio to plain (exactly 1.0 for plain)."""
        return statistics.median(self.ratios) if self.ratios else None

    @property
    def baseline_ratio(self) -> float | None:
        """Median over the rounds of the ratio to this variant's own baseline."""
        return statistics.median(self.baseline_ratios) if self.baseline_ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "version": self.version,
            "note": self.note,
            "settings": dict(self.settings),
            "seconds_per_step": self.seconds_per_step,
            "ratio_to_plain": self.ratio,
            "seconds_per_step_by_round": list(self.seconds),
            "ratio_to_plain_by_round": list(self.ratios),
            "baseline": self.baseline,
            "ratio_to_baseline": self.baseline_ratio,
        }


@dataclass(frozen=True)
class OverheadResult:
    """What :func:`run_overhead` measured, with the machine and settings it measured on."""

    steps: int
    rounds: int
    variants: tuple[VariantResult, ...]
    environment: dict[str, Any]

    def variant(self, name: str) -> VariantResult:
        """The result of variant ``name`` (one of :data:`VARIANTS`' names)."""
        for v in self.variants:
            if v.name == name:
                return v
        names = ", ".join(v.name for v in self.variants)
        raise ConfigError(f"no variant {name!r} in this result: it has {names}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings, environment, and per variant its medians and raw rounds."""
        return {
            "schema_version": 1,
            "benchmark": "overhead",
            "steps": self.steps,
            "rounds": self.rounds,
            "warmup_steps": self.steps,
            "workload": dict(WORKLOAD),
            "environment": self.environment,
            "variants": [v.to_dict() for v in self.variants],
        }

    def table(self) -> Table:
        """A rich table: one row per variant, the environment in the caption."""
        env = self.environment
        table = Table(
            title=f"gpukit bench overhead: {self.steps} steps × {self.rounds} rounds, "
            f"CPU, {env['threads']} thread(s)",
            caption=f"{env['cpu']}; torch {env['torch']}; Python {env['python']}; "
            f"{env['date']}\nratio: median of the per-round ratios to plain; range: their "
            "lowest and highest; × baseline: the same, to the plain loop doing the same work ("
            + ", ".join(f"{v.name}: {v.baseline}" for v in self.variants if v.baseline != "plain")
            + ")",
            title_justify="left",
            caption_justify="left",
            header_style="bold",
        )
        columns = (
            "variant",
            "version",
            "µs/step (median)",
            "× plain",
            "range",
            "× baseline",
            "settings",
        )
        for column in (*columns, "note"):
            table.add_column(column, overflow="fold", no_wrap=column in ("variant", "note"))
        for v in self.variants:
            settings = ", ".join(f"{k}={val}" for k, val in v.settings.items())
            if v.seconds_per_step is None or v.ratio is None:
                table.add_row(v.name, v.version or "-", "-", "-", "-", "-", settings, v.note)
                continue
            spread = f"{min(v.ratios):.3f}-{max(v.ratios):.3f}"
            per_step = f"{v.seconds_per_step * 1e6:.1f}"
            own = "-" if v.baseline == "plain" else f"{v.baseline_ratio:.3f}"
            table.add_row(v.name, v.version, per_step, f"{v.ratio:.3f}", spread, own, settings, "")
        return table


def run_overhead(steps: int = 200, rounds: int = 15) -> OverheadResult:
    """Time ``steps`` training steps of every variant in each of ``rounds`` rotated rounds.

    Raises ConfigError when ``steps`` or ``rounds`` is not a whole number of at least 1.

    >>> r = run_overhead(steps=2, rounds=2)
    >>> r.variant("plain").ratio, len(r.variant("gpukit-train-default").seconds)
    (1.0, 2)
    """
    check_count("steps", steps, "training steps timed per variant and round")
    check_count("rounds", rounds, "rotated rounds over the variants")
    batches = loops.make_batches(steps)
    with torch_threads(1):
        built: dict[str, list[loops.Loop]] = {}
        notes: dict[str, str] = {}
        versions = {v.name: _prepare(v, built, notes) for v in VARIANTS}
        torch.set_num_threads(1)  # in case a framework's setup changed it
        env = environment("cpu", threads=torch.get_num_threads())
        # Each run is ``steps`` steps over the same batches; warm-up included (one run each).
        runs = {name: _take_turns(instances, batches) for name, instances in built.items()}
        timings = time_rounds(runs, rounds, per=steps, warmup=INSTANCES)
    results = tuple(
        VariantResult(v.name, versions[v.name], note=notes[v.name], settings=v.settings())
        if v.name in notes
        else VariantResult(
            v.name,
            versions[v.name],
            timings.seconds[v.name],
            timings.ratios(v.name, "plain"),
            settings=v.settings(),
            baseline=v.baseline,
            baseline_ratios=timings.ratios(v.name, v.baseline),
        )
        for v in VARIANTS
    )
    return OverheadResult(steps, rounds, results, env)


def _take_turns(instances: list[loops.Loop], batches: list[loops.Batch]) -> Callable[[], None]:
    """One run over ``batches`` per call, by each instance in turn."""
    turns = itertools.cycle(instances)
    return lambda: next(turns)(batches)


def _instances(variant: _Variant) -> list[loops.Loop]:
    return [variant.build(*loops.make_model_and_optimizer()) for _ in range(INSTANCES)]


def _prepare(
    variant: _Variant, built: dict[str, list[loops.Loop]], notes: dict[str, str]
) -> str | None:
    """Build ``variant``'s loop into ``built`` (or say in ``notes`` why not); its version."""
    if not variant.modules:
        built[variant.name] = _instances(variant)
        return variant.version
    try:
        module = loops.import_first(variant.modules)
    except ImportError as err:
        missing = loops.is_missing(err, variant.modules)
        notes[variant.name] = "not installed" if missing else f"not usable: {err}"
        return None
    package = importlib.import_module(module.__name__.split(".")[0])
    version = getattr(module, "__version__", None) or getattr(package, "__version__", None)
    # An optional framework that breaks (a version clash with this torch) must not cost the
    # numbers of the others.
    try:
        built[variant.name] = _instances(variant)
    except Exception as err:
        notes[variant.name] = f"failed: {type(err).__name__}: {err}"
    return str(version) if version is not None else None


def run(
    quick: bool = False,
    devices: Sequence[torch.device] | None = None,
    steps: int | None = None,
    rounds: int | None = None,
) -> BenchResult:
    """The suite's entry point: :func:`run_overhead` as a :class:`BenchResult`. CPU only, on
    purpose (see the module docstring), whatever ``devices`` says.

    >>> run(quick=True, steps=2, rounds=1).rows[0]["variant"]
    'plain'
    """
    default_steps, default_rounds = QUICK if quick else FULL
    return as_result(run_overhead(steps or default_steps, rounds or default_rounds), quick)


def as_result(result: OverheadResult, quick: bool = False) -> BenchResult:
    """The overhead result in the suite's form: one row per variant."""
    rows = []
    for v in result.variants:
        rows.append(
            {
                "variant": v.name,
                "version": v.version,
                "us_per_step": v.seconds_per_step * 1e6 if v.seconds_per_step else None,
                "ratio": v.ratio,
                "low": min(v.ratios) if v.ratios else None,
                "high": max(v.ratios) if v.ratios else None,
                "baseline": v.baseline,
                "ratio_to_baseline": v.baseline_ratio if v.baseline != "plain" else None,
                "settings": ", ".join(f"{k}={val}" for k, val in v.settings.items()),
                "note": v.note,
            }
        )
    default = result.variant("gpukit-train-default")
    return BenchResult(
        experiment="overhead",
        title=f"overhead: {result.steps} steps x {result.rounds} rounds, CPU, "
        f"{result.environment['threads']} thread(s)",
        keys=("variant",),
        columns=(
            Column("variant"),
            Column("version", compare=False),
            Column("us_per_step", "time per step", "µs", 1),
            Column("ratio", "× plain", "", 3),
            Column("low", "lowest", "", 3, compare=False),
            Column("high", "highest", "", 3, compare=False),
            Column("ratio_to_baseline", "× baseline", "", 3),
            Column("note"),
        ),
        rows=rows,
        summary={
            "gpukit train defaults x plain-logged": default.baseline_ratio,
            "gpukit x plain": result.variant("gpukit").ratio,
        },
        notes=[
            "× plain: median of the per-round ratios to plain; lowest/highest: their range",
            "× baseline: the same, to the plain loop doing the same work "
            "(gpukit-train-default and the loggers: plain-logged)",
            "the limit: 1.000, the plain loop itself; a busy machine widens the range first",
        ],
        parameters={
            "steps": result.steps,
            "rounds": result.rounds,
            "quick": quick,
            "workload": dict(WORKLOAD),
        },
        environment=result.environment,
        raw={"variants": [v.to_dict() for v in result.variants]},
    )


def plot(result: BenchResult, path: Path) -> None:
    """Each wrapper's time per step over plain's, with the range over the rounds."""
    from gpukit.bench.plotting import figure

    rows = [r for r in result.rows if r["ratio"] is not None]
    with figure(
        path,
        "Per-step cost of a training wrapper (tiny MLP, CPU, 1 thread)",
        "time per step / plain PyTorch's (median of the rounds; whiskers: their range)",
        "variant",
        size=(7.5, 0.45 * len(rows) + 1.6),
    ) as ax:
        names = [r["variant"] for r in rows]
        ratios = [r["ratio"] for r in rows]
        errors = [
            [r["ratio"] - r["low"] for r in rows],
            [r["high"] - r["ratio"] for r in rows],
        ]
        bars = ax.barh(names, ratios, xerr=errors, color="tab:blue", alpha=0.8, capsize=3)
        ax.axvline(1.0, color="grey", linestyle=":")
        ax.invert_yaxis()
        for bar, ratio in zip(bars, ratios, strict=True):  # the value inside its bar
            ax.annotate(
                f"{ratio:.3f}",
                (0.02, bar.get_y() + bar.get_height() / 2),
                va="center",
                fontsize=8,
                color="white",
            )
