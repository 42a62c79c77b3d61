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

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch


def chunk_sizes(total: int, parts: int) -> list[int]:
    """``total`` items over at most ``parts`` chunks as evenly as possible (larger ones first);
    never an empty chunk, so a batch smaller than ``parts`` gives ``total`` chunks of one."""
    parts = max(1, min(parts, total))
    base, extra = divmod(total, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def batch_size(obj: Any) -> int | None:
    """The first dimension of the first tensor (of at least one dimension) inside ``obj``."""
    for tensor in _tensors(obj):
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

    return [map_structure(obj, functools.partial(_call_with, piece, i)) for i in range(len(sizes))]


def _call_with(fn: Callable[[torch.Tensor, int], Any], i: int, tensor: torch.Tensor) -> Any:
    return fn(tensor, i)


def map_structure(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every tensor; containers keep their types."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_structure(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_structure(v, fn) for v in obj)
    if isinstance(obj, Mapping):
        return _same_mapping(obj, {k: map_structure(v, fn) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: map_structure(getattr(obj, f.name), fn)
            for f in dataclasses.fields(obj)
            if f.init
        }
        return dataclasses.replace(obj, **changes)
    return obj


def zip_structures(objs: Sequence[Any], fn: Callable[[list[torch.Tensor]], Any]) -> Any:
    """Combine structures of the same shape: ``fn`` gets the tensors found at one place in all
    of them. Values that are not tensors are taken from the first structure."""
    first = objs[0]
    if isinstance(first, torch.Tensor):
        return fn(list(objs))
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(zip_structures(vs, fn) for vs in zip(*objs, strict=True)))
    if isinstance(first, (list, tuple)):
        return type(first)(zip_structures(vs, fn) for vs in zip(*objs, strict=True))
    if isinstance(first, Mapping):
        return _same_mapping(first, {k: zip_structures([o[k] for o in objs], fn) for k in first})
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        changes = {
            f.name: zip_structures([getattr(o, f.name) for o in objs], fn)
            for f in dataclasses.fields(first)
            if f.init
        }
        return dataclasses.replace(first, **changes)
    return first


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping of ``original``'s type holding ``items``; types whose constructor wants more
    than a dict (a defaultdict's factory) are copied and refilled; anything else is a dict."""
    with contextlib.suppress(TypeError):
        return type(original)(items)  # type: ignore[call-arg]
    if isinstance(original, MutableMapping):
        rebuilt = copy.copy(original)
        rebuilt.clear()
        rebuilt.update(items)
        return rebuilt
    return items


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
