"""What a failed step must put back before it is tried again, kept at the least cost.

A forward changes more than gradients: buffers (BatchNorm's running statistics and batch
count) and random generators (dropout). An out-of-memory retry must start from exactly where
the step began, so both are saved before each attempt and restored after a failure:

- buffers: only those a forward actually changes. The first step saves them all; once it has
  succeeded, the buffers it changed are found (by their version counters, bumped by Python's
  in-place writes, and by comparing values on the device, read back once, since kernels such
  as BatchNorm's write running statistics without bumping them). Later steps save just those,
  and those of normalisation layers. A model without such buffers copies nothing per step; a
  BatchNorm model copies its running statistics on the device (no read). A buffer that starts
  changing later by a Python in-place write is caught by its version when a step fails, and the
  retry is refused rather than run from a state that is not the step's start.
- random generators: the CPU's, and those of the GPUs this process drives, never the others
  (touching another GPU's generator would create a CUDA context there).

>>> import torch
>>> bn = torch.nn.BatchNorm1d(2)
>>> guard = BufferGuard([bn])
>>> saved = guard.save()
>>> _ = bn(torch.randn(4, 2))
>>> guard.restore(saved)
>>> bn.num_batches_tracked.item(), bn.running_mean.tolist()
(0, [0.0, 0.0])
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gpukit.devices import Device
from gpukit.errors import ConfigError

# Layers whose kernels write running statistics in place without bumping the version counter.
_NORMS: tuple[type, ...] = tuple(
    c
    for c in (
        getattr(nn.modules.batchnorm, "_NormBase", None),
        getattr(nn.modules.instancenorm, "_InstanceNorm", None),
    )
    if c is not None
)


class BufferGuard:
    """Saves and restores the buffers of ``modules`` that a step changes."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        named = [
            (f"{n}.{b}" if n else b, t, isinstance(m, _NORMS))
            for model in modules
            for n, m in model.named_modules()
            for b, t in m.named_buffers(recurse=False)
        ]
        self.names = [n for n, _, _ in named]
        self.buffers = [b for _, b, _ in named]
        self.norms = {i for i, (_, _, norm) in enumerate(named) if norm}
        self.changing: list[int] | None = None  # learnt after the first successful step
        self.unwatched: list[int] = []  # the others: only their versions are kept

    def save(self) -> SavedBuffers:
        """Copies of the buffers the coming step may change (all of them the first time), and
        the version of each buffer not copied: a retry must see it unchanged."""
        buffers = self.buffers
        if not buffers:  # every step of a model without buffers: nothing to keep
            return _NOTHING
        if self.changing is None:
            every = range(len(buffers))
            return SavedBuffers(
                [(i, buffers[i].detach().clone()) for i in every],
                [(i, buffers[i]._version) for i in every],
            )
        return SavedBuffers(
            [(i, buffers[i].detach().clone()) for i in self.changing],
            [(i, buffers[i]._version) for i in self.unwatched],
        )

    def succeeded(self, saved: SavedBuffers) -> None:
        """After the first good step: find the buffers it changed (one read per device, once;
        the caller keeps it out of the trace)."""
        if self.changing is not None:
            return
        changed = {i for i, v in saved.versions if self.buffers[i]._version != v}
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        with torch.no_grad():
            for i, copy in saved.copies:
                if i not in changed and copy.numel():
                    differs = (copy != self.buffers[i]).any()
                    by_device.setdefault(differs.device, []).append((i, differs))
        for found in by_device.values():
            flags = torch.stack([d for _, d in found]).tolist()
            changed |= {i for (i, _), flag in zip(found, flags, strict=True) if flag}
        self.changing = sorted(changed | self.norms)
        self.unwatched = [i for i in range(len(self.buffers)) if i not in set(self.changing)]

    def restore(self, saved: SavedBuffers) -> None:
        """Put the saved buffers back; refuse when a buffer not copied changed in the attempt."""
        copied = {i for i, _ in saved.copies}
        moved = [
            self.names[i]
            for i, version in saved.versions
            if i not in copied and self.buffers[i]._version != version
        ]
        if moved:
            raise ConfigError(
                f"out-of-memory recovery cannot redo this step: buffer(s) {', '.join(moved[:3])} "
                "changed in place during the failed attempt although the first step left them "
                "alone, so their starting values were not saved. Use oom='raise', or change "
                "such buffers from the first step on"
            )
        with torch.no_grad():
            for i, copy in saved.copies:
                self.buffers[i].copy_(copy)


@dataclass
class SavedBuffers:
    """What ``BufferGuard.save`` kept: (index, copy) and (index, version) pairs."""

    copies: list[tuple[int, torch.Tensor]]
    versions: list[tuple[int, int]]


_NOTHING = SavedBuffers([], [])  # what a model without buffers keeps (never changed)


class RngState:
    """The CPU's random generator and those of the GPUs in ``devices``, saved now."""

    def __init__(self, gpus: Sequence[int]) -> None:
        self.cpu = torch.default_generator.get_state()  # torch.get_rng_state, one call less
        self.cuda: list[tuple[int, Any]] = (
            [(i, torch.cuda.get_rng_state(i)) for i in gpus]
            if gpus and torch.cuda.is_initialized()
            else []
        )

    @staticmethod
    def gpus_of(devices: Sequence[Device]) -> list[int]:
        """The GPU indices among ``devices``: the only generators this process may touch."""
        return sorted({d.index for d in devices if d.type == "cuda" and d.index is not None})

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for index, state in self.cuda:
            torch.cuda.set_rng_state(state, index)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
