"""What the step reads from the live run and advances in it, declared here as the narrow shapes
it needs, so that the step sits below the Runtime and never imports it.

The Runtime's own objects meet these shapes (its ``Settings`` and ``TrainState``); so does any
stand-in with the same members:

>>> import types
>>> def needs(settings: StepSettings) -> int:
...     return settings.accumulate
>>> needs(types.SimpleNamespace(accumulate=2))
2
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn


class StepSettings(Protocol):
    """The settings the step follows: micro-steps per optimizer step, the norm it clips to,
    and what running out of memory does."""

    @property
    def accumulate(self) -> int: ...

    @property
    def clip(self) -> float | None: ...

    @property
    def oom(self) -> str: ...

    def recovers(self, distributed: bool) -> bool:
        """Whether out-of-memory errors are recovered in a run that is ``distributed`` or not."""
        ...


class StepState(Protocol):
    """What the step trains and advances: the models as setup returned them and their
    optimizers, the step counters, and the micro-batch split out-of-memory recovery found (with
    one entry in ``oom_events`` per recovery)."""

    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    global_step: int
    micro_step: int
    stepped_at: int
    oom_split: int
    oom_events: list[dict[str, Any]]

    def optimizer_stepped(
        self, optimizer: torch.optim.Optimizer, ran: bool, flag: torch.Tensor | None
    ) -> None:
        """``optimizer`` stepped (``ran``: False when skipped; ``flag``: the non-finite
        guard's device flag): what follows the optimizer's steps counts it."""
        ...
