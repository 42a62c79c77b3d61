"""How every ``gpukit bench`` experiment times its variants: one helper, so that they all
measure the same way.

- Warm-up: each variant runs untimed first (lazy initialisation, optimizer state, caches).
- Rounds: each round times every variant once, the order rotated by one each round, so slow
  drifts of the machine and order effects (a variant that runs right after another inherits
  its caches, or its garbage) hit all variants alike.
- The garbage collector runs before each timed block and is off during it (as in ``timeit``),
  so one variant's garbage is not collected on another's clock; the objects alive after the
  warm-up are frozen out of the collections, which then take milliseconds instead of a fifth
  of a second with torch's objects in the heap.
- ``synchronize`` (see :func:`gpukit.devices.clock.synchronizer`) runs before each clock read:
  a GPU returns before its work is done, and a clock read without it would time the launches,
  not the work.
- Ratios: per round, then the median of those; each compares timings taken moments apart, so
  a drift between rounds cancels out, which the ratio of two medians would not do.

>>> t = time_rounds({"a": lambda: None, "b": lambda: None}, rounds=3)
>>> len(t.seconds["a"]), t.ratios("a", "a")
(3, (1.0, 1.0, 1.0))
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from gpukit.devices.clock import synchronizer, time_once
from gpukit.errors import ConfigError

T = TypeVar("T")

__all__ = ["check_count", "synchronizer", "take_turns", "time_once", "time_rounds", "torch_threads"]


@dataclass(frozen=True)
class Timings:
    """Seconds per unit of work (a step) of each variant, one value per round."""

    seconds: dict[str, tuple[float, ...]]

    def median(self, name: str) -> float:
        """Median over the rounds of ``name``'s seconds per unit.

        >>> Timings({"a": (3.0, 1.0, 2.0)}).median("a")
        2.0
        """
        return statistics.median(self.seconds[name])

    def ratios(self, name: str, baseline: str) -> tuple[float, ...]:
        """``name``'s time over ``baseline``'s, round by round.

        >>> Timings({"a": (2.0, 3.0), "b": (1.0, 2.0)}).ratios("a", "b")
        (2.0, 1.5)
        """
        pairs = zip(self.seconds[name], self.seconds[baseline], strict=True)
        return tuple(s / b for s, b in pairs)

    def ratio(self, name: str, baseline: str) -> float:
        """Median of the per-round ratios (exactly 1.0 for the baseline itself).

        >>> Timings({"a": (2.0, 3.0, 9.0), "b": (1.0, 2.0, 3.0)}).ratio("a", "b")
        2.0
        """
        return statistics.median(self.ratios(name, baseline))


def time_rounds(
    runs: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    per: int = 1,
    warmup: int = 1,
    synchronize: Callable[[], None] | None = None,
) -> Timings:
    """Warm up every run ``warmup`` times, then time each once per round for ``rounds``
    rotated rounds; seconds are divided by ``per`` (the steps one run takes).

    >>> t = time_rounds({"noop": lambda: None}, rounds=2, per=10)
    >>> len(t.seconds["noop"]), t.median("noop") >= 0
    (2, True)
    """
    check_count("rounds", rounds, "rounds over the variants")
    check_count("per", per, "units of work in one run")
    order = list(runs)
    for _ in range(warmup):
        for name in order:
            runs[name]()
    seconds: dict[str, list[float]] = {name: [] for name in order}
    gc.collect()
    gc.freeze()
    try:
        for r in range(rounds):
            shift = r % len(order) if order else 0
            for name in order[shift:] + order[:shift]:
                seconds[name].append(time_once(runs[name], synchronize) / per)
    finally:
        gc.unfreeze()
    return Timings({name: tuple(s) for name, s in seconds.items()})


def take_turns(copies: Sequence[Callable[[T], object]], argument: T) -> Callable[[], None]:
    """One run: a call of the next of ``copies`` (identical loops, built apart) on
    ``argument``, each in turn. One model's place in memory can make it a few percent faster or
    slower than an identical one; taking turns over the rounds spreads that over them instead
    of giving it to one variant.

    >>> calls = []
    >>> run = take_turns([lambda x: calls.append(("a", x)), lambda x: calls.append(("b", x))], 1)
    >>> run(); run(); run()
    >>> calls
    [('a', 1), ('b', 1), ('a', 1)]
    """
    turns = itertools.cycle(copies)

    def run() -> None:
        next(turns)(argument)

    return run


@contextlib.contextmanager
def torch_threads(threads: int = 1) -> Iterator[None]:
    """Run the block with ``threads`` torch intra-op threads, restoring the setting after.

    A tiny model's step is dispatch and Python: more threads only add scheduling noise.

    >>> before = torch.get_num_threads()
    >>> with torch_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_count(name: str, value: object, meaning: str = "") -> None:
    """ConfigError unless ``value`` is a whole number of at least 1 (``True`` is not one).

    >>> check_count("steps", 0, "steps per round")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: steps=0: give a whole number of at least 1 (steps per round)
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        why = f" ({meaning})" if meaning else ""
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1{why}")
