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
from collections.abc import Iterator
from typing import Any, TypeVar, cast

import torch
from torch import nn

from gpukit._util.text import described, type_name
from gpukit._util.tree import map_tensors
from gpukit.devices.device import DeviceSpec, device
from gpukit.errors import ConfigError, DeviceError

T = TypeVar("T")


def to(obj: T, spec: DeviceSpec, *, copy: bool = False, non_blocking: bool | None = None) -> T:
    """Return ``obj`` with every tensor in it on the device ``spec`` names.

    Walks dicts, lists, tuples, namedtuples and dataclasses, and keeps their types; other
    values pass through unchanged. A tensor that appears twice stays one tensor after the move.
    With ``copy=False`` a tensor already on the target is returned as is; with ``copy=True``
    every tensor is new memory. Modules move in place, as ``Module.to`` does (``copy=True``
    moves a deep copy instead). ``non_blocking=None`` means: non-blocking exactly for pinned
    CPU tensors going to a GPU, the one case where it overlaps the copy safely.

    Refused with a :class:`~gpukit.errors.GpukitError`: an iterator or generator (moving it
    would consume it: pass ``list(it)``), data that holds itself, tensors on the ``meta``
    device (they have no data to move), and flags that are not bools.

    >>> import torch, gpukit as gk
    >>> gk.to((torch.zeros(1), "label"), "cpu")
    (tensor([0.]), 'label')
    """
    for name, value, allowed in (
        ("copy", copy, (True, False)),
        ("non_blocking", non_blocking, (True, False, None)),
    ):
        if not (value is None or isinstance(value, bool)) or value not in allowed:
            choices = " or ".join(map(str, allowed))
            raise ConfigError(f"gk.to({name}={described(value)}): give {choices}")
    if isinstance(obj, Iterator):
        raise ConfigError(
            f"gk.to() got a {type_name(obj)}: its items exist only as it is consumed, so it "
            "cannot be moved as it is; pass list(...) of it, or move each item as it comes"
        )
    return move_to(obj, device(spec).torch, copy=copy, non_blocking=non_blocking)


def move_to(
    obj: T, target: torch.device, *, copy: bool = False, non_blocking: bool | None = None
) -> T:
    """``to()`` for a target already resolved: what loops call per batch, without re-checking
    the device every time."""
    # The mover gives back the structure it was given, each leaf moved.
    return cast(T, _Mover(target, copy, non_blocking).move(obj))


class _Mover:
    """What one move needs: the target, and how tensors and modules go there."""

    def __init__(self, target: torch.device, copy: bool, non_blocking: bool | None) -> None:
        self.target = target
        self.copy = copy
        self.non_blocking = non_blocking

    def move(self, obj: Any) -> Any:
        # The walker maps each tensor once, so aliases stay aliased after the move.
        return map_tensors(obj, self._leaf, leaf=(torch.Tensor, nn.Module))

    def _leaf(self, obj: torch.Tensor | nn.Module) -> Any:
        if isinstance(obj, nn.Module):
            if self.target.type != "meta" and any(
                t.is_meta for t in (*obj.parameters(), *obj.buffers())
            ):
                raise _meta_error(f"the module {type_name(obj)}", self.target)
            module = copy_module.deepcopy(obj) if self.copy else obj
            return module.to(self.target, non_blocking=self._non_blocking_for(None))
        if obj.device == self.target and not self.copy:
            return obj
        if obj.is_meta:
            raise _meta_error("a tensor", self.target)
        return obj.to(self.target, non_blocking=self._non_blocking_for(obj), copy=self.copy)

    def _non_blocking_for(self, t: torch.Tensor | None) -> bool:
        if self.non_blocking is not None:
            return self.non_blocking
        if t is None or self.target.type != "cuda" or t.device.type != "cpu":
            return False
        return _is_pinned(t)


def _meta_error(what: str, target: torch.device) -> DeviceError:
    return DeviceError(
        f"cannot move {what} from the meta device to {target}: meta tensors have a shape but "
        "no data. Create it on the device instead (torch.device(...) as a context, or "
        "module.to_empty(device=...) and then load or initialise the weights)"
    )


def _is_pinned(t: torch.Tensor) -> bool:
    try:
        return bool(t.is_pinned())
    except RuntimeError:  # some builds raise instead of answering False without an accelerator
        return False
