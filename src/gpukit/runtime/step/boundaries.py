"""The points of a step where the Runtime does more than step: the hooks :class:`Stepper`
calls, so that the step does not need to know what happens there (the heartbeat, injected
faults, periodic checkpoints, preemption: see ``gpukit.lifecycle.boundaries``).

The step declares what it calls (:class:`StepBoundaries`, a protocol); whatever implements
those methods serves, without importing this module, so the packages below the runtime never
import it.

>>> NoBoundaries().poison_loss()
False
>>> isinstance(NoBoundaries(), StepBoundaries)
True
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class StepBoundaries(Protocol):
    """What the Runtime does where a step begins and ends (see ``gpukit.lifecycle.boundaries``)."""

    def step_begins(self, step: int, forward: bool = True) -> None:
        """Optimizer step ``step + 1`` begins; ``forward``: with its forward (else that ran)."""

    def beat(self, phase: str, step: int) -> None:
        """The step entered ``phase``."""

    def poison_loss(self) -> bool:
        """Whether an injected fault makes this step's loss NaN."""
        ...

    def step_ended(self, step: int) -> None:
        """Optimizer step ``step`` ended."""


class NoBoundaries:
    """Boundaries where nothing happens: a step run without a run around it."""

    def step_begins(self, step: int, forward: bool = True) -> None:
        """Nothing to do when a step begins."""

    def beat(self, phase: str, step: int) -> None:
        """No heartbeat to write."""

    def poison_loss(self) -> bool:
        """No fault is injected."""
        return False

    def step_ended(self, step: int) -> None:
        """Nothing to do when a step ends."""
