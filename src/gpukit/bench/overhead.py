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
- ``gpukit+heartbeat``: ``gpukit-train-default`` on a rank gpukit's launcher watches: its
  heartbeat (:mod:`gpukit.launch.heartbeat`: the phase, the seconds spent in each, the step's
  end, memory writes only) written at each boundary of the step into a file in a temporary
  folder, as under ``gpukit launch``; compared with ``gpukit-train-default`` (the goal: within
  1.02x). No loader is set up here, so its beats are the step's own (forward, backward,
  optimizer, the step's end); a set-up loader adds two per batch (data, forward);
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gpukit import __version__
from gpukit.bench import overhead_loops as loops
from gpukit.bench.environment import environment
from gpukit.bench.overhead_result import OverheadResult, VariantResult, as_result
from gpukit.bench.result import BenchResult
from gpukit.bench.timing import check_count, take_turns, time_rounds, torch_threads

TITLE = "what a training wrapper adds to every step (gpukit, Accelerate, Fabric vs plain PyTorch)"
# Steps per round and rounds: the full run's (gpukit bench overhead's defaults) and --quick's.
FULL, QUICK = (200, 15), (20, 5)

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
    _Variant(
        "gpukit+heartbeat",
        loops.heartbeat_loop,
        loops.train_default,
        version=__version__,
        baseline="gpukit-train-default",
    ),
    _Variant("accelerate", loops.accelerate_loop, lambda: dict(loops.ACCELERATE), ("accelerate",)),
    _Variant("fabric", loops.fabric_loop, lambda: dict(loops.FABRIC), loops.FABRIC_MODULES),
)


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
        runs = {name: take_turns(instances, batches) for name, instances in built.items()}
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
