"""What a Runtime shows about itself: its settings, its progress and where this process sits.

Each view reads one of the Runtime's public parts when it is read: its frozen settings
(``config``), its :class:`TrainState` (``state``) or its strategy (``strategy``, which
``strategy="auto"`` may replace at ``rt.setup``: a view never keeps the old one). Views only
read, but the step counters, which a resumed loop may set. A method whose work one of the
Runtime's private parts does (``rt.gather_for_metrics``, ``rt.progress``, ...) is a
:class:`Delegate`: that part's method, bound to the part.

>>> import gpukit as gk
>>> rt = gk.Runtime(devices="cpu", accumulate=2)
>>> rt.accumulate, rt.global_step, rt.rank
(2, 0, 0)
>>> rt.global_step = 5
>>> rt.state.global_step
5
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

from gpukit.runtime.settings import Settings
from gpukit.runtime.state import TrainState
from gpukit.strategies import Strategy

T = TypeVar("T")
C = TypeVar("C")
P = ParamSpec("P")
R = TypeVar("R")


class Parts(Protocol):
    """What a view reads from: the Runtime's public parts."""

    config: Settings
    state: TrainState
    strategy: Strategy


class View(Generic[T]):
    """A read-only attribute, ``read`` from the Runtime's parts each time it is read (with
    ``doc`` for ``help``): ``accumulate = View(lambda rt: rt.config.accumulate)``."""

    def __init__(self, read: Callable[[Parts], T], doc: str | None = None) -> None:
        self.read = read
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, rt: None, owner: type | None = None) -> View[T]: ...

    @overload
    def __get__(self, rt: Parts, owner: type | None = None) -> T: ...

    def __get__(self, rt: Parts | None, owner: type | None = None) -> View[T] | T:
        return self if rt is None else self.read(rt)

    def __set__(self, rt: Parts, value: object) -> None:
        # As a property without a setter: an assignment is refused, never kept beside it.
        raise AttributeError(f"property {self.name!r} of {type(rt).__name__!r} has no setter")


class Counter:
    """One of the step counters of the Runtime's ``state`` (the field of the same name): read
    there, and set there, as a loop that resumes by itself may do."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        if not isinstance(getattr(TrainState(), name, None), int):
            raise TypeError(f"TrainState has no counter {name!r}")
        self.name = name

    @overload
    def __get__(self, rt: None, owner: type | None = None) -> Counter: ...

    @overload
    def __get__(self, rt: Parts, owner: type | None = None) -> int: ...

    def __get__(self, rt: Parts | None, owner: type | None = None) -> Counter | int:
        if rt is None:
            return self
        value: int = getattr(rt.state, self.name)
        return value

    def __set__(self, rt: Parts, value: int) -> None:
        setattr(rt.state, self.name, value)


class Delegate(Generic[C, P, R]):
    """A method of the Runtime that is ``method`` of the part it holds in its attribute
    ``part``: ``rt.progress`` is ``rt._progress.progress``, with the signature and docstring
    written beside the work (the Runtime's class shows ``method`` itself)."""

    def __init__(self, part: str, method: Callable[Concatenate[C, P], R]) -> None:
        self.part, self.method = part, method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, rt: None, owner: type | None = None) -> Callable[Concatenate[C, P], R]: ...

    @overload
    def __get__(self, rt: Parts, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(
        self, rt: Parts | None, owner: type | None = None
    ) -> Callable[Concatenate[C, P], R] | Callable[P, R]:
        if rt is None:
            return self.method
        bound: Callable[P, R] = types.MethodType(self.method, getattr(rt, self.part))
        return bound


def described(rt: Any) -> str:
    """What ``print(rt)`` shows: ``Runtime(strategy=ddp, devices=2, precision=bf16-mixed,
    rank=0/2)``; the strategy's and the precision's own reprs say more."""
    devices = len(rt.strategy.devices)
    return (
        f"Runtime(strategy={rt.strategy.name}, devices={devices}, "
        f"precision={rt.precision.name}, rank={rt.rank}/{rt.world_size})"
    )
