"""Strategies by name, and the ``"auto"`` choice.

A strategy joins with :func:`register` (one line below for each built-in one); from then on
``gk.Runtime(strategy=name)``, ``gk.plan`` (which reads its :class:`Traits`) and ``gpukit
bench`` know it.

>>> from gpukit.strategies.registry import make_strategy, traits_of
>>> make_strategy("single").name
'single'
>>> traits_of("single").max_devices
1
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from gpukit._util.text import described
from gpukit.devices import Device
from gpukit.errors import ConfigError
from gpukit.strategies.base import Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.dp import DP, DPBalanced
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.single import SingleDevice
from gpukit.strategies.traits import Traits

# Registered strategies by name, in the order they were registered (the order plans and
# benchmarks list them in).
STRATEGIES: dict[str, type[Strategy]] = {}
# Names that mean something else where a strategy is asked for.
_RESERVED = ("auto",)


def register(cls: type[Strategy]) -> type[Strategy]:
    """Make strategy class ``cls`` known by its ``name``; returns ``cls`` (a decorator too).
    It must subclass :class:`Strategy`, implement its abstract hooks, and set ``name`` (a new
    one) and ``traits`` (a :class:`Traits`, which the planner reads).

    >>> from gpukit.strategies import SingleDevice
    >>> register(SingleDevice)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: strategy name 'single' is taken by SingleDevice: ...
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(
            f"register() got {described(cls)}: give a subclass of gpukit.strategies.Strategy "
            "(the class itself, not an instance)"
        )
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.strip() or name != name.strip() or name in _RESERVED:
        raise ConfigError(
            f"strategy class {cls.__name__} has name={described(name)}: set the class attribute "
            "name to a non-empty string without surrounding spaces, other than "
            f"{', '.join(map(repr, _RESERVED))}"
        )
    if name in STRATEGIES:
        raise ConfigError(
            f"strategy name {name!r} is taken by {STRATEGIES[name].__name__}: give "
            f"{cls.__name__} another name, or unregister({name!r}) first"
        )
    if not isinstance(getattr(cls, "traits", None), Traits):
        raise ConfigError(
            f"strategy class {cls.__name__} has no traits: set the class attribute traits to a "
            "gpukit.strategies.Traits saying what it shards and communicates (the planner "
            "reads it), e.g. traits = Traits(max_devices=1) for one device"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ConfigError(
            f"strategy class {cls.__name__} does not implement {missing}: define them (each "
            "is documented on gpukit.strategies.Strategy)"
        )
    STRATEGIES[name] = cls
    return cls


def unregister(name: str) -> type[Strategy]:
    """Forget the strategy registered as ``name``; returns its class."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError(
            f"unregister({described(name)}): no such strategy; registered: {', '.join(STRATEGIES)}"
        )
    return STRATEGIES.pop(name)


def traits_of(name: str) -> Traits:
    """The traits of the strategy registered as ``name`` (what the planner reads)."""
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {described(name)}: use one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name].traits


for _builtin in (SingleDevice, DP, DPBalanced, DDP, FSDP):
    register(_builtin)


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
