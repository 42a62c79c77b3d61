"""The simulations of one planning call, remembered so that no case is simulated twice.

A planning call asks for the same case more than once: the search for the largest micro-batch
predicts around the micro-batch a plan planned again starts from, and
:func:`gpukit.planning.remedies.plan_remedies` plans one run several ways that meet (a figure
not fitting is asked again for its largest micro-batch; the figure of a smaller micro-batch is
the run planned again). A simulation is deterministic (a fixed seed, the process's random state
restored), so each case's peaks are kept for the rest of the call and handed out again. Only
within one call: a workload's module may change between calls, and a process that plans for
long would hold every case it ever simulated.

>>> calls = []
>>> def run():
...     calls.append(1)
...     return "peaks"
>>> with remembered():
...     first, again = simulated("mlp", (8,), run), simulated("mlp", (8,), run)
>>> first, again, len(calls)
('peaks', 'peaks', 1)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from typing import Any, ParamSpec, TypeVar

from gpukit.errors import SimulationUnsupported

P = ParamSpec("P")
T = TypeVar("T")

# The open call's cases: each key's result, or why it cannot be simulated. None: no call open.
_CASES: ContextVar[dict[Hashable, Any] | None] = ContextVar("gpukit_simulated_cases", default=None)


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Remember simulations until the outermost ``remembered()`` ends (one nested in another
    shares its cases)."""
    if _CASES.get() is not None:
        yield
        return
    token = _CASES.set({})
    try:
        yield
    finally:
        _CASES.reset(token)


def remembering(call: Callable[P, T]) -> Callable[P, T]:
    """``call`` with its simulations remembered (see :func:`remembered`)."""

    @functools.wraps(call)
    def remembering_call(*args: P.args, **kwargs: P.kwargs) -> T:
        with remembered():
            return call(*args, **kwargs)

    return remembering_call


def simulated(workload: object, case: Hashable, run: Callable[[], T]) -> T:
    """``run()``'s result for ``case`` of ``workload`` (a name, or an object: the same one),
    run once per open call (every time outside one); a
    :class:`~gpukit.errors.SimulationUnsupported` is remembered too, and raised again."""
    cases = _CASES.get()
    if cases is None:
        return run()
    key = (_Same(workload), case)
    if key not in cases:
        try:
            cases[key] = run()
        except SimulationUnsupported as why:
            cases[key] = why
    held = cases[key]
    if isinstance(held, SimulationUnsupported):
        raise held
    return held


class _Same:
    """A workload in a case's key: the same object (a name: the same string), whatever its
    fields hold; holding it keeps its identity from being reused while the call is open."""

    def __init__(self, workload: object) -> None:
        self.workload = workload

    def __hash__(self) -> int:
        return hash(self.workload) if isinstance(self.workload, str) else id(self.workload)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Same):
            return NotImplemented
        if isinstance(self.workload, str):
            return self.workload == other.workload
        return self.workload is other.workload
