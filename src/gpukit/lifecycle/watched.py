"""What a watched rank adds to its heartbeat beside the phases the step beats: where its data
loading starts and ends, the samples a step takes, and its device's memory.

Only a rank gpukit's launcher watches (a heartbeat exists) gets these; without one a set-up
loader calls the Runtime's own hooks, unchanged. With one, a set-up loader beats "data" before
it fetches a batch (after the boundary between steps, where a pending save is made) and
"forward" once the batch is handed: the time from a step's end to the batch in hand is the
data's, told apart from the user's forward. Each beat is the memory write a beat always is.

The device's memory is read from the caching allocator's counters (allocated, its peak,
reserved): host-side bookkeeping, no device synchronisation, read by the heartbeat at a step's
end at most once a second.

>>> reader = memory_reader(torch.device("cpu"))
>>> reader is None  # on a CPU the launcher reads the process's memory itself
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpukit.launch.heartbeat import Heartbeat

Handed = Callable[[Any, int, Any], None]  # (loader, position in its pass, batch)
MemoryReader = Callable[[], tuple[int, int, int]]


def memory_reader(device: torch.device) -> MemoryReader | None:
    """A reader of ``device``'s allocated, peak allocated and reserved bytes (-1 for a counter
    the allocator has not got: CUDA not started yet), or None when it is not a CUDA device."""
    if device.type != "cuda":
        return None
    index = cuda_index(device)

    def read() -> tuple[int, int, int]:
        # One call for the three counters, nested as the allocator keeps them (the flat
        # form, and memory_allocated & co. built on it, rebuild every key's name each call).
        # Before CUDA starts it returns nothing: unknown, and CUDA is not started for it.
        stats = torch.cuda.memory_stats_as_nested_dict(index)
        return (
            _counter(stats, "allocated_bytes", "current"),
            _counter(stats, "allocated_bytes", "peak"),
            _counter(stats, "reserved_bytes", "current"),
        )

    return read


def cuda_index(device: torch.device) -> int:
    """``device``'s index; a bare "cuda" is device 0, the current device until a program sets
    another (asking torch would start CUDA, which a reader must not do)."""
    return device.index if device.index is not None else 0


def _counter(stats: dict[str, Any], name: str, which: str) -> int:
    value = stats.get(name, {}).get("all", {}).get(which)
    return int(value) if value is not None else -1


class WatchedRank:
    """The figures a watched rank's ``heartbeat`` carries beside its phases: the device it
    computes on (``device``: its memory read through :func:`memory_reader`), and, from the
    set-up loaders' hooks (:meth:`loader_hooks`), the samples an optimizer step takes (the
    batch size of the loader that handed the step's last batch, times ``accumulate``)."""

    def __init__(self, heartbeat: Heartbeat, device: torch.device, accumulate: int) -> None:
        self.heartbeat = heartbeat
        self.accumulate = accumulate
        self._batch_size = 0  # of the loader that handed the last batch, 0: unknown
        if device.type == "cuda":
            heartbeat.device = cuda_index(device)
            heartbeat.memory_reader = memory_reader(device)

    def loader_hooks(
        self, at_boundary: Callable[[], None], handed: Handed
    ) -> tuple[Callable[[], None], Handed]:
        """A set-up loader's ``on_batch`` and ``on_handed``: ``at_boundary`` then the "data"
        beat before each batch is fetched, ``handed`` then the "forward" beat once it is."""
        heartbeat = self.heartbeat

        def before_batch() -> None:
            at_boundary()  # a save pending from the last step is made first, then the data
            heartbeat.beat("data", heartbeat.step)

        def after_handed(loader: Any, position: int, batch: Any) -> None:
            handed(loader, position, batch)
            self._batch_size = loader.batch_size or 0  # a batch sampler's size is unknown
            heartbeat.beat("forward", heartbeat.step)

        return before_batch, after_handed

    def step_ends(self) -> None:
        """Before a step's end beats: the samples that step took, as the loaders told them
        (an evaluation loader's batches between steps are not the step's: the training
        loader hands the next step's batches before it ends)."""
        self.heartbeat.samples_per_step = self._batch_size * self.accumulate
