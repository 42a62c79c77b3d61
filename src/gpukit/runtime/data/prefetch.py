"""Batches handed out on the device: on CUDA from pinned memory, the next batch copied on a
side stream while the current one is used."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gpukit._util.tree import tensors
from gpukit.devices.move import move_to


def on_device(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """``batches`` moved to ``device``: on CUDA each copied on a side stream while the one
    before it is used (see :func:`_prefetched`), elsewhere moved as it is asked for."""
    if device.type == "cuda":
        return _prefetched(batches, device)
    return (move_to(b, device) for b in batches)


def _prefetched(batches: Iterator[Any], device: torch.device) -> Iterator[Any]:
    """Copy batch i+1 on a side stream while batch i is used on the current stream."""
    stream = torch.cuda.Stream(device)

    def start_copy(batch: Any) -> Any:
        with torch.cuda.stream(stream):
            return move_to(batch, device, non_blocking=True)

    pending = None
    for batch in batches:
        following = start_copy(batch)
        if pending is not None:
            yield _ready(pending, stream)
        pending = following
    if pending is not None:
        yield _ready(pending, stream)


def _ready(batch: Any, copy_stream: torch.cuda.Stream) -> Any:
    """Make the current stream wait for the copy, and tell the allocator the tensors are now
    used there, so their memory is not handed out again while kernels still read it."""
    current = torch.cuda.current_stream(copy_stream.device)
    current.wait_stream(copy_stream)
    for t in tensors(batch):  # every tensor of any batch structure the copy made
        t.record_stream(current)
    return batch
