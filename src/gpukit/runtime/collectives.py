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
from typing import Any, get_args

import torch

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies import ReduceOp, Strategy

Number = int | float | bool
OPS: tuple[str, ...] = get_args(ReduceOp)
_INT64 = (-(2**63), 2**63 - 1)


def all_reduce(strategy: Strategy, value: torch.Tensor | Number, op: ReduceOp) -> Any:
    """``value`` combined over the ranks by ``op``: a tensor where ``value`` was, or a number."""
    if not (isinstance(op, str) and op in OPS):
        raise ConfigError(
            f"rt.all_reduce(op={described(op)}): use one of {', '.join(map(repr, OPS))}"
        )
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
    world = strategy.world_size
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ConfigError(
            f"rt.broadcast(src={described(src)}): give the rank that holds the value, a whole "
            f"number from 0 to {world - 1} (this job has {world} rank(s))"
        )
    if isinstance(value, torch.Tensor):
        tensor, back = _on_device(strategy, value, "broadcast", False)
        return back(strategy.broadcast(tensor, src))
    return strategy.broadcast_object(value, src)


def _on_device(
    strategy: Strategy, value: Any, name: str, mean: bool
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    device = strategy.device.torch
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ConfigError(
                f"rt.{name} got a tensor on the meta device: it has a shape but no values to "
                "combine; pass a tensor that holds data"
            )
        home = value.device
        return value.detach().to(device), (lambda t: t.to(home) if t.device != home else t)
    if isinstance(value, bool | int | float):
        exact = isinstance(value, bool | int) and not mean
        if exact and not _INT64[0] <= value <= _INT64[1]:
            raise ConfigError(
                f"rt.{name} got the int {described(value)}, beyond a 64-bit integer (what "
                "the ranks exchange): pass it as a float (float(x)), or as a tensor"
            )
        tensor = torch.tensor(value, dtype=torch.int64 if exact else torch.float64)

        def as_number(t: torch.Tensor) -> Any:
            return t.item() if t.dim() == 0 else t.tolist()

        return tensor.to(device), as_number
    raise ConfigError(
        f"rt.{name} got {described(value)}: give a tensor (on any device) or a Python "
        "number; for a dict or list of them, call it once per value (or stack them in one tensor)"
    )
