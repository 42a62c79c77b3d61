"""Strategies by name: how training is spread over devices and processes.

>>> from gpukit.strategies import make_strategy
>>> make_strategy("single").name
'single'
"""

from __future__ import annotations

from gpukit.errors import ConfigError
from gpukit.strategies.base import ReduceOp, Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.dp import DP, DPBalanced, PerDevice
from gpukit.strategies.single import SingleDevice

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleDevice, DP, DPBalanced, DDP)
}


def make_strategy(spec: str | Strategy) -> Strategy:
    """A fresh strategy for a registered name, or the strategy object given."""
    if isinstance(spec, Strategy):
        return spec
    if spec not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy {spec!r}: use one of auto, {', '.join(STRATEGIES)} "
            "(or pass a strategy object such as gk.strategies.DDP(...))"
        )
    return STRATEGIES[spec]()


__all__ = [
    "DDP",
    "DP",
    "STRATEGIES",
    "DPBalanced",
    "PerDevice",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "make_strategy",
]
