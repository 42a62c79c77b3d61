"""Move tensors, nested containers of tensors, and modules to a device.

>>> import torch, gpukit as gk
>>> x = torch.ones(3)
>>> gk.to(x, "cpu") is x                  # already there: the same tensor (MXNet as_in_context)
True
>>> gk.to(x, "cpu", copy=True) is x       # always new memory (MXNet copyto)
False
>>> batch = gk.to({"x": x, "y": [x, 1]}, "cpu")
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from gpukit.devices.device import DeviceSpec, device

T = TypeVar("T")


def to(obj: T, spec: DeviceSpec, *, copy: bool = False, non_blocking: bool | None = None) -> T:
    """Return ``obj`` with every tensor in it on the device ``spec`` names.

    Walks dicts, lists, tuples, namedtuples and dataclasses, and keeps their types; other
    values pass through unchanged. A tensor that appears twice stays one tensor after the move.
    With ``copy=False`` a tensor already on the target is returned as is; with ``copy=True``
    every tensor is new memory. Modules move in place, as ``Module.to`` does (``copy=True``
    moves a deep copy instead). ``non_blocking=None`` means: non-blocking exactly for pinned
    CPU tensors going to a GPU, the one case where it overlaps the copy safely.

    >>> import torch, gpukit as gk
    >>> gk.to((torch.zeros(1), "label"), "cpu")
    (tensor([0.]), 'label')
    """
    return move_to(obj, device(spec).torch, copy=copy, non_blocking=non_blocking)


def move_to(
    obj: T, target: torch.device, *, copy: bool = False, non_blocking: bool | None = None
) -> T:
    """``to()`` for a target already resolved: what loops call per batch, without re-checking
    the device every time."""
    return _Mover(target, copy, non_blocking).move(obj)


class _Mover:
    def __init__(self, target: torch.device, copy: bool, non_blocking: bool | None) -> None:
        self.target = target
        self.copy = copy
        self.non_blocking = non_blocking
        self.moved: dict[int, torch.Tensor] = {}  # id(source) -> result, to keep aliases aliased

    def move(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj)
        if isinstance(obj, nn.Module):
            module = copy_module.deepcopy(obj) if self.copy else obj
            return module.to(self.target, non_blocking=self._non_blocking_for(None))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._dataclass(obj)
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*(self.move(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.move(v) for v in obj)
        if isinstance(obj, Mapping):
            return self._mapping(obj)
        return obj

    def _tensor(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        if key not in self.moved:
            if t.device == self.target and not self.copy:
                self.moved[key] = t
            else:
                self.moved[key] = t.to(
                    self.target, non_blocking=self._non_blocking_for(t), copy=self.copy
                )
        return self.moved[key]

    def _non_blocking_for(self, t: torch.Tensor | None) -> bool:
        if self.non_blocking is not None:
            return self.non_blocking
        if t is None or self.target.type != "cuda" or t.device.type != "cpu":
            return False
        return _is_pinned(t)

    def _dataclass(self, obj: Any) -> Any:
        out = copy_module.copy(obj)
        for f in dataclasses.fields(obj):
            # object.__setattr__ also works on frozen dataclasses, and skips __init__ so
            # fields with init=False survive.
            object.__setattr__(out, f.name, self.move(getattr(obj, f.name)))
        return out

    def _mapping(self, obj: Mapping[Any, Any]) -> Any:
        items = {k: self.move(v) for k, v in obj.items()}
        if isinstance(obj, dict):
            out = copy_module.copy(obj)  # keeps the subclass and e.g. a defaultdict's factory
            out.update(items)
            return out
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # some builds raise instead of answering False without an accelerator
        return False
