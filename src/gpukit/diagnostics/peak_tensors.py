"""Each device's peak of tensor memory over the first optimizer steps of a real run.

A prediction of the planner and a measurement must be the same quantity to compare: the bytes
tensors hold at the step's peak, not what the allocator reserves or the process's resident
memory. CUDA's caching allocator counts it already (``torch.cuda.max_memory_allocated``): the
counter is reset when the window opens and read once when it closes, nothing per step. A CPU
has no such counter, so :class:`~gpukit.diagnostics.live_tensors.LiveTensors` counts live
tensor storages op by op; that costs one Python call per op, so it runs only through the window:

- it opens just before ``rt.setup``, so that what setup makes (DDP's buckets, FSDP's shards)
  is counted, and files what setup made beside the model as communication;
- it closes after the first :data:`MEASURED_STEPS` optimizer steps: the steady step's peak is
  reached by the second step, once the optimizer's state exists.

This is the sequence the planner's simulation replays over fake tensors: model and optimizer
built, counter on, ``watch``, ``rt.setup``, ``watch`` of the unwrapped model, ``file_made``,
then batches from the loader through ``rt.train_step`` and ``rt.log``.

>>> import torch
>>> peaks = PeakTensors(["cpu"])
>>> model = torch.nn.Linear(256, 256)
>>> optimizer = torch.optim.AdamW(model.parameters())
>>> peaks.start(model, optimizer)
>>> peaks.after_setup(model, optimizer)
>>> for _ in range(MEASURED_STEPS):
...     model(torch.ones(8, 256)).sum().backward()
...     optimizer.step()
...     peaks.after_step()
>>> peaks.active, peaks.result()["cpu"] > 4 * model.weight.nelement() * 4
(False, True)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gpukit.diagnostics.live_tensors import LiveTensors

# Optimizer steps measured: the first builds the optimizer's state, the second is a steady
# step, the third confirms it.
MEASURED_STEPS = 3


class PeakTensors:
    """The peak bytes of tensors on each of ``devices`` over a run's first optimizer steps.

    CUDA devices are read from the caching allocator, others (the CPU) counted by a
    :class:`~gpukit.diagnostics.live_tensors.LiveTensors` active only inside the window. Call
    :meth:`start` just before ``rt.setup``, :meth:`after_setup` right after it,
    :meth:`after_step` after each optimizer step, and :meth:`stop` when the run ends (or
    fails): it closes a window the run was too short to fill. ``steps`` defaults to
    :data:`MEASURED_STEPS`; 0 measures nothing.

    >>> PeakTensors(["cpu"], steps=0).result()
    {'cpu': None}
    """

    def __init__(self, devices: Iterable[torch.device | str], steps: int | None = None) -> None:
        self.devices = list(dict.fromkeys(_name(torch.device(d)) for d in devices))
        self.steps = MEASURED_STEPS if steps is None else steps
        self.cuda = [d for d in self.devices if d.startswith("cuda")]
        self.counted = [d for d in self.devices if d not in self.cuda]
        self.live: LiveTensors | None = None
        self.active = False
        self.done = 0  # optimizer steps seen in the window
        self._cuda_peaks: dict[str, int] = {}

    def start(self, model: nn.Module, optimizer: Any) -> None:
        """Open the window before ``rt.setup``: count ``model``'s and ``optimizer``'s tensors
        from here on, and start CUDA's peak afresh."""
        if self.active or self.steps <= 0:
            return
        if self.cuda and torch.cuda.is_initialized():  # before CUDA starts there is no peak
            for d in self.cuda:
                torch.cuda.reset_peak_memory_stats(d)
        if self.counted:
            self.live = LiveTensors()
            self.live.__enter__()
            self.live.watch(model, [optimizer])
        self.active = True

    def after_setup(self, model: nn.Module, optimizer: Any) -> None:
        """After ``rt.setup``: file the unwrapped ``model`` and the ``optimizer`` (their tensors
        may be new: moved, cast or sharded), and what setup made beside them as communication."""
        if self.active and self.live is not None:
            self.live.watch(model, [optimizer])
            self.live.file_made("communication")

    def after_step(self) -> None:
        """One optimizer step ended; the window closes after the last measured one."""
        if not self.active:
            return
        self.done += 1
        if self.done >= self.steps:
            self.stop()

    def stop(self) -> None:
        """Close the window (again is harmless): read CUDA's peaks, take the counter off."""
        if not self.active:
            return
        self.active = False
        for d in self.cuda:
            self._cuda_peaks[d] = int(torch.cuda.max_memory_allocated(d))
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def result(self) -> dict[str, int | None]:
        """Each device's peak in bytes, or None where nothing was measured (no window yet)."""
        peaks: dict[str, int | None] = dict.fromkeys(self.devices)
        peaks.update(self._cuda_peaks)
        if self.live is not None and not self.active:
            peaks.update({d: self.live.peak.get(d, 0) for d in self.counted})
        return peaks


def _name(device: torch.device) -> str:
    """The name a memory report gives ``device``: ``cpu``, ``cuda:1``."""
    if device.type == "cpu":
        return "cpu"
    return str(device) if device.index is not None else f"{device.type}:0"
