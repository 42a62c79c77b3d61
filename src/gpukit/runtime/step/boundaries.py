"""The points of a step where the Runtime does more than step: the hooks :class:`Stepper`
calls, so that the step does not need to know what happens there (the heartbeat, injected
faults, periodic checkpoints, preemption: see ``gpukit.lifecycle.boundaries``).

>>> StepBoundaries().poison_loss()
False
"""

from __future__ import annotations


class StepBoundaries:
    """What the Runtime does where a step begins and ends (see ``gpukit.lifecycle.boundaries``);
    these defaults do nothing."""

    def step_begins(self, step: int) -> None:
        """Optimizer step ``step + 1`` begins."""

    def beat(self, phase: str, step: int) -> None:
        """The step entered ``phase``."""

    def poison_loss(self) -> bool:
        """Whether an injected fault makes this step's loss NaN."""
        return False

    def step_ended(self, step: int) -> None:
        """Optimizer step ``step`` ended."""
