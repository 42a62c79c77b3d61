"""Splitting a batch into chunks along its first dimension, whatever structure holds it.

The same rule serves three places: ``dp`` scattering inputs over devices, ``dp-balanced``
scattering targets exactly as the inputs were, and out-of-memory recovery cutting a step's
batch into micro-batches. A tensor is split when its first dimension is the batch size;
everything else (scalars, 0-d tensors, a tensor of another length, strings) is repeated in every
chunk, as it would be seen by a model called once per chunk.

>>> import torch
>>> chunk_sizes(10, 3)
[4, 3, 3]
>>> x, y = torch.arange(5), {"y": torch.arange(5) * 10, "tag": "a"}
>>> [c[1]["y"].tolist() for c in split((x, y), [3, 2])]
[[0, 10, 20], [30, 40]]
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gpukit._util.tree import map_tensors, tensors


def chunk_sizes(total: int, parts: int) -> list[int]:
    """``total`` items over at most ``parts`` chunks as evenly as possible (larger ones first);
    never an empty chunk, so a batch smaller than ``parts`` gives ``total`` chunks of one."""
    if parts == 1:
        return [total]  # every step without accumulation: nothing to divide
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def batch_size(obj: Any) -> int | None:
    """The first dimension of the first tensor (of at least one dimension) inside ``obj``."""
    # The usual (inputs, targets) batch, answered without walking: this runs every step.
    first = obj[0] if isinstance(obj, (tuple, list)) and obj else obj
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return int(first.shape[0])
    for tensor in tensors(obj):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    return None


def split(obj: Any, sizes: Sequence[int]) -> list[Any]:
    """``obj`` cut into ``len(sizes)`` chunks of those sizes along the batch dimension."""
    total = sum(sizes)
    pieces: dict[int, list[torch.Tensor]] = {}  # id(tensor) -> its chunks, cut once

    def piece(tensor: torch.Tensor, i: int) -> torch.Tensor:
        if not (tensor.dim() > 0 and tensor.shape[0] == total):
            return tensor
        if id(tensor) not in pieces:
            pieces[id(tensor)] = list(torch.split(tensor, list(sizes)))
        return pieces[id(tensor)][i]

    return [map_tensors(obj, functools.partial(_call_with, piece, i)) for i in range(len(sizes))]


def _call_with(fn: Callable[[torch.Tensor, int], Any], i: int, tensor: torch.Tensor) -> Any:
    return fn(tensor, i)
