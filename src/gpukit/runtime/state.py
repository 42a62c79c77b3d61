"""What a run has and where it stands: the objects ``setup`` saw and the step counters.

The step, the checkpoint and the Runtime share this one object instead of reaching into each
other: the checkpoint saves and restores it, the step advances it.

>>> state = TrainState()
>>> state.global_step, state.oom_split
(0, 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.schedulers import Scheduler


@dataclass
class TrainState:
    """The models (as ``setup`` returned them), optimizers, loaders, schedulers and other
    objects with a state of a run, the program's own state (``rt.track``: name to object), and
    its progress: ``global_step`` optimizer steps, ``micro_step`` backward passes (``stepped_at``:
    the micro-step of the last ``rt.step``), and the micro-batch split out-of-memory recovery
    found (``oom_split``, with one entry in ``oom_events`` per recovery)."""

    modules: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    loaders: list[DeviceLoader] = field(default_factory=list)
    schedulers: list[Scheduler] = field(default_factory=list)
    objects: list[Any] = field(default_factory=list)
    tracked: dict[str, Any] = field(default_factory=dict)
    global_step: int = 0
    micro_step: int = 0
    stepped_at: int = 0
    oom_split: int = 1
    oom_events: list[dict[str, Any]] = field(default_factory=list)

    def optimizer_stepped(
        self, optimizer: torch.optim.Optimizer, ran: bool, flag: torch.Tensor | None
    ) -> None:
        """``optimizer`` stepped (``ran``: False when skipped; ``flag``: the non-finite guard's
        device flag, 1.0 when it skipped): the schedulers that follow it count it."""
        for scheduler in self.schedulers:
            scheduler.optimizer_stepped(optimizer, ran, flag)

    def clear(self) -> None:
        """Let go of the models, optimizers, loaders and the rest (the counters stay)."""
        self.modules.clear()
        self.optimizers.clear()
        self.loaders.clear()
        self.schedulers.clear()
        self.objects.clear()
        self.tracked.clear()
