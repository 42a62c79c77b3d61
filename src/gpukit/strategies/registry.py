"""Strategies by name, and the ``"auto"`` choice.

>>> from gpukit.strategies.registry import make_strategy
>>> make_strategy("single").name
'single'
"""

from __future__ import annotations

from collections.abc import Sequence

from gpukit._util.text import described
from gpukit.devices import Device
from gpukit.errors import ConfigError
from gpukit.strategies.base import Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.dp import DP, DPBalanced
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.single import SingleDevice

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (SingleDevice, DP, DPBalanced, DDP, FSDP)
}


def make_strategy(spec: str | Strategy) -> Strategy:
    """A fresh strategy for a registered name, or the strategy object given."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, type) and issubclass(spec, Strategy):
        raise ConfigError(
            f"strategy={spec.__name__} is the class, not a strategy: pass an instance, "
            f"e.g. strategy={spec.__name__}(), or the name {spec.name!r}"
        )
    if not isinstance(spec, str) or spec not in STRATEGIES:
        raise ConfigError(
            f"unknown strategy {described(spec)}: use one of auto, {', '.join(STRATEGIES)} "
            "(or pass a strategy object such as gk.strategies.DDP(...))"
        )
    return STRATEGIES[spec]()


def choose(spec: str | Strategy, devices: Sequence[Device], launched: bool) -> Strategy:
    """The strategy for ``spec`` over ``devices``, configured. ``"auto"``: ddp when this
    process is one rank of a launched job or several devices are asked for, else single.

    >>> from gpukit.devices import device
    >>> choose("auto", [device("cpu")], launched=False).name
    'single'
    """
    if isinstance(spec, str) and spec == "auto":
        spec = "ddp" if launched or len(devices) > 1 else "single"
    strategy = make_strategy(spec)
    strategy.configure(list(devices))
    return strategy
