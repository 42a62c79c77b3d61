"""The strategies the planner plans: every registered one, known by its traits alone.

The planner never names a strategy: what sets one apart (what it shards, gathers and
communicates, the device counts it runs on) is its :class:`~gpukit.strategies.Traits`, read
here through the registry, so a strategy registered later is planned like the built-in ones.

>>> traits("single").max_devices, one_device() in names()
(1, True)
"""

from __future__ import annotations

from collections.abc import Sequence

from gpukit.strategies.registry import STRATEGIES, traits_of
from gpukit.strategies.traits import STATES, Traits


def names() -> tuple[str, ...]:
    """Every registered strategy, in the registry's order."""
    return tuple(STRATEGIES)


def traits(name: str) -> Traits:
    """The traits of strategy ``name`` (a ConfigError listing the names for an unknown one)."""
    return traits_of(name)


def defaults(counts: Sequence[int], checkpointing: str) -> list[str]:
    """What ``gk.plan`` plans when no strategies are given: with activation checkpointing,
    the strategies that have it; else every strategy that runs on one of ``counts``."""
    if checkpointing != "off":
        return list(with_checkpointing())
    return [s for s in names() if any(traits(s).runs_on(n) for n in counts)]


def with_checkpointing() -> tuple[str, ...]:
    """The strategies with their own activation checkpointing setting."""
    return tuple(s for s in names() if traits(s).activation_checkpointing)


def sharding() -> str | None:
    """The first strategy that shards every state over its devices (the remedy when a
    replica does not fit), or None."""
    return next((s for s in names() if traits(s).sharded >= set(STATES)), None)


def one_device() -> str:
    """The first strategy that trains on exactly one device in this process."""
    found = [
        s
        for s in names()
        if traits(s).max_devices == 1
        and not (traits(s).process_per_device or traits(s).drives_all_devices)
    ]
    assert found, "the registry lost its one-device strategy"
    return found[0]


__all__ = ["defaults", "names", "one_device", "sharding", "traits", "with_checkpointing"]
