"""``overhead``: what a training wrapper adds to the cost of every step.

The same tiny training loop (the built-in ``mlp`` workload's 32-64-64-4 MLP, AdamW, batch 64,
cross-entropy, float32) runs as

- ``plain``: PyTorch alone: forward, loss, ``backward``, ``step``, ``zero_grad(set_to_none=True)``;
- ``gpukit``: through ``Runtime(devices="cpu", precision="32")``: ``rt.backward``, ``rt.step``;
- ``accelerate``: through Hugging Face Accelerate (``Accelerator(cpu=True)``), where installed;
- ``fabric``: through Lightning Fabric (``Fabric(accelerator="cpu", devices=1)``), where installed.

Every variant starts from the same weights and iterates over the same list of batches already in
memory (no DataLoader), so only the wrapper differs. A model this small makes the step as cheap
as it gets, which is where a wrapper's Python overhead shows the most.

Method:

- CPU only, one torch thread (restored afterwards): the work is dispatch and Python, and more
  threads only add scheduling noise. On the CPU every op has finished when it returns, so the
  clock is read right after the loop; timing a GPU would need ``torch.cuda.synchronize()`` first,
  which is why nothing here may move to a GPU.
- Warm-up: every variant runs ``steps`` untimed steps (lazy initialisation, optimizer state).
- ``rounds`` rounds; each times ``steps`` steps of every variant with ``time.perf_counter``, the
  order rotated each round, so slow drifts of the machine and order effects hit all variants
  alike. The garbage collector runs before each timed block and is off during it (as in
  ``timeit``), so one variant's garbage is not collected on another's clock.
- Per variant: the median seconds per step over the rounds, and the ratio to plain as the
  median of the per-round ratios; each of those compares timings taken moments apart, so a
  drift between rounds cancels out, which the ratio of the two medians would not do.

>>> result = run_overhead(steps=2, rounds=1)
>>> [(v.name, v.available) for v in result.variants][:2]
[('plain', True), ('gpukit', True)]
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from rich.table import Table
from torch import nn
from torch.optim import Optimizer

from gpukit import __version__
from gpukit.bench.environment import environment
from gpukit.errors import ConfigError
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import mlp

Batch = tuple[torch.Tensor, torch.Tensor]
Loop = Callable[[Sequence[Batch]], None]  # runs one training step per batch

BATCH_SIZE = 64
LR = 1e-3
SEED = 0
FABRIC_MODULES = ("lightning.fabric", "lightning_fabric")  # `lightning`, or Fabric alone
WORKLOAD = {
    "model": "mlp 32-64-64-4, ReLU",
    "optimizer": f"AdamW(lr={LR})",
    "loss": "cross_entropy",
    "batch_size": BATCH_SIZE,
    "dtype": "float32",
    "device": "cpu",
    "seed": SEED,
    "data": "a list of batches built once, in memory",
}


def make_model_and_optimizer(seed: int = SEED) -> tuple[nn.Module, Optimizer]:
    """A fresh MLP with the weights ``seed`` gives, and its AdamW (global RNG untouched).

    >>> a, _ = make_model_and_optimizer()
    >>> b, _ = make_model_and_optimizer()
    >>> torch.equal(a[0].weight, b[0].weight)
    True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp.make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def make_batches(steps: int) -> list[Batch]:
    """``steps`` batches of 64 samples of the ``mlp`` data, the same on every call.

    >>> [tuple(t.shape) for t in make_batches(3)[0]]
    [(64, 32), (64,)]
    """
    x, y = mlp.make_dataset(steps * BATCH_SIZE).tensors
    return list(zip(x.split(BATCH_SIZE), y.split(BATCH_SIZE), strict=True))


def plain_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The reference loop: PyTorch alone.

    >>> model, optimizer = make_model_and_optimizer()
    >>> plain_loop(model, optimizer)(make_batches(2))
    """

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def gpukit_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through gpukit's ``Runtime`` on the CPU in float32.

    >>> model, optimizer = make_model_and_optimizer()
    >>> gpukit_loop(model, optimizer)(make_batches(2))
    """
    rt = Runtime(devices="cpu", precision="32")
    model, optimizer = rt.setup(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)  # steps, then zero_grad(set_to_none=True)

    return train


def accelerate_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through Hugging Face Accelerate on the CPU (raises ImportError without it)."""
    accelerator = _import_first(("accelerate",)).Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def fabric_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through Lightning Fabric on the CPU (raises ImportError without it)."""
    fabric = _import_first(FABRIC_MODULES).Fabric(accelerator="cpu", devices=1)
    model, optimizer = fabric.setup(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


@dataclass(frozen=True)
class _Variant:
    name: str
    build: Callable[[nn.Module, Optimizer], Loop]
    modules: tuple[str, ...] = ()  # one of these must import; () for the always-there ones
    version: str | None = None  # of the always-there ones; the others say at import


VARIANTS = (
    _Variant("plain", plain_loop, version=torch.__version__),
    _Variant("gpukit", gpukit_loop, version=__version__),
    _Variant("accelerate", accelerate_loop, ("accelerate",)),
    _Variant("fabric", fabric_loop, FABRIC_MODULES),
)


@dataclass(frozen=True)
class VariantResult:
    """One variant's timings, per round; empty with a ``note`` when it could not run."""

    name: str
    version: str | None
    seconds: tuple[float, ...] = ()  # seconds per step, one per round
    ratios: tuple[float, ...] = ()  # these seconds / plain's in the same round
    note: str = ""  # "not installed", or why it failed

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "version": self.version,
            "note": self.note,
            "seconds_per_step": self.seconds_per_step,
            "ratio_to_plain": self.ratio,
            "seconds_per_step_by_round": list(self.seconds),
            "ratio_to_plain_by_round": list(self.ratios),
        }


@dataclass(frozen=True)
class OverheadResult:
    """What :func:`run_overhead` measured, with the machine and settings it measured on."""

    steps: int
    rounds: int
    variants: tuple[VariantResult, ...]
    environment: dict[str, Any]

    def variant(self, name: str) -> VariantResult:
        """The result of variant ``name`` ("plain", "gpukit", "accelerate" or "fabric")."""
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
            f"{env['date']}\nratio: median of the per-round ratios to plain",
            title_justify="left",
            caption_justify="left",
            header_style="bold",
        )
        for column in ("variant", "version", "µs/step (median)", "× plain", "range", "note"):
            table.add_column(column, overflow="fold")
        for v in self.variants:
            if v.seconds_per_step is None or v.ratio is None:
                table.add_row(v.name, v.version or "-", "-", "-", "-", v.note)
                continue
            spread = f"{min(v.ratios):.3f}-{max(v.ratios):.3f}"
            table.add_row(
                v.name, v.version, f"{v.seconds_per_step * 1e6:.1f}", f"{v.ratio:.3f}", spread, ""
            )
        return table


def run_overhead(steps: int = 200, rounds: int = 15) -> OverheadResult:
    """Time ``steps`` training steps of every variant in each of ``rounds`` interleaved rounds.

    Raises ConfigError when ``steps`` or ``rounds`` is not a whole number of at least 1.

    >>> r = run_overhead(steps=2, rounds=2)
    >>> r.variant("plain").ratio, len(r.variant("gpukit").seconds)
    (1.0, 2)
    """
    _check_count("steps", steps, "training steps timed per variant and round")
    _check_count("rounds", rounds, "interleaved rounds over the variants")
    batches = make_batches(steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loops: dict[str, Loop] = {}
        notes: dict[str, str] = {}
        versions = {v.name: _prepare(v, loops, notes) for v in VARIANTS}
        torch.set_num_threads(1)  # in case a framework's setup changed it
        env = environment("cpu", threads=torch.get_num_threads())
        for loop in loops.values():
            loop(batches)
        # Frozen, the objects alive now (torch's are most of them) are left out of every later
        # collection, which then costs milliseconds instead of a fifth of a second.
        gc.collect()
        gc.freeze()
        order = list(loops)
        seconds: dict[str, list[float]] = {name: [] for name in order}
        for r in range(rounds):
            shift = r % len(order)
            for name in order[shift:] + order[:shift]:
                seconds[name].append(_time(loops[name], batches) / steps)
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
    results = tuple(
        VariantResult(v.name, versions[v.name], note=notes[v.name])
        if v.name in notes
        else VariantResult(
            v.name,
            versions[v.name],
            tuple(seconds[v.name]),
            tuple(s / p for s, p in zip(seconds[v.name], seconds["plain"], strict=True)),
        )
        for v in VARIANTS
    )
    return OverheadResult(steps, rounds, results, env)


def _prepare(variant: _Variant, loops: dict[str, Loop], notes: dict[str, str]) -> str | None:
    """Build ``variant``'s loop into ``loops`` (or say in ``notes`` why not); its version."""
    if not variant.modules:
        loops[variant.name] = variant.build(*make_model_and_optimizer())
        return variant.version
    try:
        module = _import_first(variant.modules)
    except ImportError as err:
        notes[variant.name] = (
            "not installed" if _is_missing(err, variant.modules) else f"not usable: {err}"
        )
        return None
    package = importlib.import_module(module.__name__.split(".")[0])
    version = getattr(module, "__version__", None) or getattr(package, "__version__", None)
    # An optional framework that breaks (a version clash with this torch) must not cost the
    # numbers of the others.
    try:
        loops[variant.name] = variant.build(*make_model_and_optimizer())
    except Exception as err:
        notes[variant.name] = f"failed: {type(err).__name__}: {err}"
    return str(version) if version is not None else None


def _import_first(names: Sequence[str]) -> ModuleType:
    """The first of ``names`` that imports. When none does, the ImportError of an installed
    one that lacks a dependency if there is one (more useful than "not installed"), else the
    first."""
    errors: list[ImportError] = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as err:
            errors.append(err)
    raise next((e for e in errors if not _is_missing(e, names)), errors[0])


def _is_missing(err: ImportError, names: Sequence[str]) -> bool:
    """Whether ``err`` says that one of ``names`` itself (or its package) is not installed."""
    missing = err.name
    return bool(missing) and any(n == missing or n.startswith(f"{missing}.") for n in names)


def _time(loop: Loop, batches: Sequence[Batch]) -> float:
    """Seconds ``loop`` takes over ``batches`` (the CPU has finished when it returns)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        loop(batches)
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def _check_count(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1 ({meaning})")
