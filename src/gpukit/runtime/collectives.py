"""Collectives on what a training loop holds: tensors on any device, and plain numbers.

NCCL only moves tensors that live on this rank's GPU, so a tensor on another device goes
there for the collective and its result comes back to where the tensor was; a Python number
goes in as a float64 (or int64) tensor and comes back as a number.

>>> import torch, gpukit as gk
>>> single = gk.Runtime(devices="cpu").strategy
>>> all_reduce(single, 3, "sum"), all_gather(single, 2.5), broadcast(single, torch.ones(2), 0)
(3, [2.5], tensor([1., 1.]))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpukit.errors import ConfigError
from gpukit.strategies import ReduceOp, Strategy

Number = int | float | bool


def all_reduce(strategy: Strategy, value: torch.Tensor | Number, op: ReduceOp) -> Any:
    """``value`` combined over the ranks by ``op``: a tensor where ``value`` was, or a number."""
    tensor, back = _on_device(strategy, value, "all_reduce", op == "mean")
    return back(strategy.all_reduce(tensor, op))


def all_gather(strategy: Strategy, value: torch.Tensor | Number) -> Any:
    """Every rank's ``value`` in rank order: tensors stacked on a new first dimension (the
    same shape on every rank), numbers as a list."""
    tensor, back = _on_device(strategy, value, "all_gather", False)
    gathered = strategy.all_gather(tensor)
    return back(gathered) if isinstance(value, torch.Tensor) else gathered.tolist()


def broadcast(strategy: Strategy, value: Any, src: int) -> Any:
    """Rank ``src``'s ``value`` on every rank: a tensor (the same shape and dtype on every
    rank) where ``value`` was, or any picklable object."""
    if isinstance(value, torch.Tensor):
        tensor, back = _on_device(strategy, value, "broadcast", False)
        return back(strategy.broadcast(tensor, src))
    return strategy.broadcast_object(value, src)


def _on_device(
    strategy: Strategy, value: Any, name: str, mean: bool
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    device = strategy.device.torch
    if isinstance(value, torch.Tensor):
        home = value.device
        return value.detach().to(device), (lambda t: t.to(home) if t.device != home else t)
    if isinstance(value, bool | int | float):
        exact = isinstance(value, bool | int) and not mean
        tensor = torch.tensor(value, dtype=torch.int64 if exact else torch.float64)

        def as_number(t: torch.Tensor) -> Any:
            return t.item() if t.dim() == 0 else t.tolist()

        return tensor.to(device), as_number
    raise ConfigError(
        f"rt.{name} got a {type(value).__name__}: give a tensor (on any device) or a Python "
        "number; for a dict or list of them, call it once per value (or stack them in one tensor)"
    )
