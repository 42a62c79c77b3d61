"""What a Runtime shows about itself: its settings, its progress and where this process sits.

Read-only views (the step counters can also be set, as a resumed loop may) over the Runtime's
frozen settings (``config``), its :class:`TrainState`, its metrics and its strategy.
"""

from __future__ import annotations

from typing import Any

import torch

from gpukit.devices import Device
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.outputs.metrics import Metrics
from gpukit.runtime.settings import Settings
from gpukit.runtime.state import TrainState
from gpukit.strategies import Strategy


class RuntimeViews:
    """The properties of :class:`~gpukit.Runtime` that only read (or set a counter)."""

    config: Settings
    state: TrainState
    _metrics: Metrics
    strategy: Strategy

    # -- settings and progress ---------------------------------------------------------------
    @property
    def accumulate(self) -> int:
        return self.config.accumulate

    @property
    def clip(self) -> float | None:
        return self.config.clip

    @property
    def seed(self) -> int | None:
        return self.config.seed

    @property
    def log_every(self) -> int:
        return self.config.log_every

    @property
    def oom(self) -> str:
        return self.config.oom

    @property
    def nonfinite(self) -> str | None:
        return self.config.nonfinite

    @property
    def settings(self) -> Settings:
        """Every setting this Runtime was made with (``gpukit.runtime.settings``)."""
        return self.config

    @property
    def global_step(self) -> int:
        """Optimizer steps taken."""
        return self.state.global_step

    @global_step.setter
    def global_step(self, value: int) -> None:
        self.state.global_step = value

    @property
    def micro_step(self) -> int:
        """Backward passes taken."""
        return self.state.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self.state.micro_step = value

    @property
    def oom_split(self) -> int:
        """Micro-batches per accumulation step, raised by out-of-memory recovery."""
        return self.state.oom_split

    @oom_split.setter
    def oom_split(self, value: int) -> None:
        self.state.oom_split = value

    @property
    def oom_events(self) -> list[dict[str, Any]]:
        """One record per out-of-memory recovery: step, micro-batch before and after."""
        return self.state.oom_events

    @property
    def loaders(self) -> list[DeviceLoader]:
        return self.state.loaders

    @property
    def history(self) -> list[dict[str, float]]:
        """What ``rt.log`` read back, one record per window. A window closes every
        ``log_every`` calls, when a loader's pass runs to its end, at ``rt.save``, and when the
        function ``rt.launch`` runs returns (points every rank reaches together, so the last
        partial window is there at the end and any rank may read this alone); reading it never
        reads anything back itself, so a progress display may read it every step.
        ``rt.flush_logs()`` closes the window now."""
        return self._metrics.history

    # -- where this process sits ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device this process trains on, as a ``torch.device``: ``x.to(rt.device)`` and
        ``torch.zeros(2, device=rt.device)`` work as they do with plain PyTorch."""
        return self.strategy.device.torch

    @property
    def device_info(self) -> Device:
        """gpukit's :class:`Device` for ``rt.device``: its name, memory and compute
        capability."""
        return self.strategy.device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0
