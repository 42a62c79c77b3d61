"""Batches handed out on the device: on CUDA from pinned memory, the next batch copied on a
side stream while the current one is used.

Each batch's copy is followed by an event recorded on the side stream; when the batch is
handed out, the current stream waits for that event alone. (Waiting for the side stream
itself would also wait for the copy of the batch after it, already enqueued there by then, and
the copy would no longer overlap the step.) A batch that holds no tensor (strings, dicts of
lists of numbers) has nothing to copy: it is handed out as it came, with no stream work.

>>> import torch
>>> [b for b in on_device(iter([(torch.ones(1), "a"), ["text", 2]]), torch.device("cpu"))]
[(tensor([1.]), 'a'), ['text', 2]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpukit._util.tree import tensors
from gpukit.devices.move import move_to

# Told, on CUDA, the two events recorded on the current stream around its wait for a batch's
# copy (``gpukit.runtime.data.wait``: the device's own time waiting for data).
Marks = Callable[[torch.cuda.Event, torch.cuda.Event], None]


def on_device(
    batches: Iterator[Any],
    device: torch.device,
    marks: Marks | None = None,
    read_ahead: bool = False,
) -> Iterator[Any]:
    """``batches`` moved to ``device``: on CUDA each copied on a side stream while the one
    before it is used (see :func:`_prefetched`), elsewhere moved as it is asked for, or, with
    ``read_ahead``, read one ahead of the one handed out as on CUDA (Accelerate's loader reads
    so: a dataset that draws random numbers as it reads draws them at the same moments)."""
    if device.type == "cuda":
        return _prefetched(batches, device, marks)
    moved = (move_to(b, device) for b in batches)
    return _one_ahead(moved) if read_ahead else moved


def _one_ahead(batches: Iterator[Any]) -> Iterator[Any]:
    held: list[Any] = []
    for batch in batches:
        if held:
            yield held.pop()
        held.append(batch)
    yield from held


def _prefetched(batches: Iterator[Any], device: torch.device, marks: Marks | None) -> Iterator[Any]:
    """Copy batch i+1 on a side stream while batch i is used on the current stream."""
    stream = torch.cuda.Stream(device)
    pending: tuple[Any, torch.cuda.Event | None] | None = None
    for batch in batches:
        following = _start_copy(batch, device, stream)
        if pending is not None:
            yield _ready(*pending, stream, marks)
        pending = following
    if pending is not None:
        yield _ready(*pending, stream, marks)


def _start_copy(
    batch: Any, device: torch.device, stream: torch.cuda.Stream
) -> tuple[Any, torch.cuda.Event | None]:
    """The batch's copy enqueued on ``stream``, and the event that marks its end there (None
    for a batch without a tensor: it is handed out as it is)."""
    if next(tensors(batch), None) is None:
        return batch, None
    with torch.cuda.stream(stream):
        moved = move_to(batch, device, non_blocking=True)
    copied = torch.cuda.Event()  # ordering only: no timing, the cheapest kind
    copied.record(stream)
    return moved, copied


def _ready(
    batch: Any,
    copied: torch.cuda.Event | None,
    copy_stream: torch.cuda.Stream,
    marks: Marks | None = None,
) -> Any:
    """Make the current stream wait for this batch's copy (its event, not the side stream:
    the next batch's copy is already enqueued there), and tell the allocator the tensors are
    now used there, so their memory is not handed out again while kernels still read it.
    The host never waits here: the wait is the device's, and ``marks`` gets two events on
    the current stream around it, read back later where the run reads the device anyway."""
    if copied is None:
        return batch
    current = torch.cuda.current_stream(copy_stream.device)
    asked = _timing_event(current) if marks is not None else None
    current.wait_event(copied)
    if marks is not None and asked is not None:
        marks(asked, _timing_event(current))
    for t in tensors(batch):  # every tensor of any batch structure the copy made
        t.record_stream(current)
    return batch


def _timing_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event
