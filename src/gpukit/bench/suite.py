"""The experiments of ``gpukit bench``, by name, and running one or all of them.

Every experiment is a module of :mod:`gpukit.bench` with

- ``TITLE``: one line saying what it answers;
- ``run(quick: bool = False) -> BenchResult``: measure on the CPU and on every GPU present
  (``quick``: sizes and repeats small enough for a 2-core CI machine);
- ``plot(result: BenchResult, path: Path) -> None``: draw the result as a PNG, from the result
  alone (so a stored JSON can be drawn again).

``run_experiment`` runs one, writing ``NAME.json`` and ``NAME.png`` under ``out`` when given.
Modules are imported on first use, so ``gpukit bench --help`` stays fast.

>>> names()[:3]
('matmul', 'transfer', 'sync')
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from gpukit.bench.result import BenchResult

# Run order of `gpukit bench all`: the physics first (compute, copies, waits, devices), then
# training (strategies, precision), then gpukit's own costs.
_MODULES = {
    "matmul": "gpukit.bench.matmul",
    "transfer": "gpukit.bench.transfer",
    "sync": "gpukit.bench.sync",
    "multidevice": "gpukit.bench.multidevice",
    "strategies": "gpukit.bench.strategies",
    "precision": "gpukit.bench.precision",
    "overhead": "gpukit.bench.overhead",
    "trace": "gpukit.bench.trace_cost",
    "speed": "gpukit.bench.speed",
    "plan": "gpukit.bench.plan",
    "calibration": "gpukit.bench.calibration",
    "restarts": "gpukit.bench.restarts",
    "save": "gpukit.bench.save_stall",
}


def names() -> tuple[str, ...]:
    """Every experiment, in the order ``gpukit bench all`` runs them."""
    return tuple(_MODULES)


def experiment(name: str) -> ModuleType:
    """The module of experiment ``name`` (see the module docstring for what it provides)."""
    return importlib.import_module(_MODULES[name])


@dataclass
class Outcome:
    """One experiment's run: its result and files, or the error that stopped it."""

    name: str
    result: BenchResult | None
    files: list[Path]
    error: str | None = None
    plot_error: str | None = None


def run_experiment(name: str, quick: bool, out: Path | None) -> Outcome:
    """Run ``name``; with ``out``, write its JSON and its plot there.

    A plot that fails does not lose the numbers: the JSON is written first and the plot's
    error is kept in the outcome.
    """
    module = experiment(name)
    result: BenchResult = module.run(quick=quick)
    files: list[Path] = []
    plot_error = None
    if out is not None:
        files.append(result.write_json(out))
        png = out / f"{name}.png"
        try:
            module.plot(result, png)
            files.append(png)
        except Exception as err:  # the numbers are worth more than their picture
            plot_error = f"{type(err).__name__}: {err}"
    return Outcome(name, result, files, plot_error=plot_error)


def run_all(quick: bool, out: Path | None, only: tuple[str, ...] = ()) -> list[Outcome]:
    """Run every experiment (or those in ``only``) in order; one that fails is reported in
    its outcome and the others still run, since a long suite must not lose an hour of
    measurements to one broken experiment."""
    outcomes = []
    for name in only or names():
        try:
            outcomes.append(run_experiment(name, quick, out))
        except Exception as err:
            tail = traceback.format_exc(limit=-3)
            outcomes.append(Outcome(name, None, [], error=f"{type(err).__name__}: {err}\n{tail}"))
    return outcomes
