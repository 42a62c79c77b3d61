"""Collectives on what a training loop holds: tensors on any device, and plain numbers.

NCCL only moves tensors that live on this rank's GPU, so a tensor on another device goes
there for the collective and its result comes back to where the tensor was; a Python number
goes in as a float64 (or int64) tensor and comes back as a number, except from
:func:`all_gather`, which stacks every rank's value in a tensor whatever it was given (so that
``all_gather(n).sum()`` works as with Accelerate's ``gather`` and Fabric's ``all_gather``).

>>> import torch, gpukit as gk
>>> single = gk.Runtime(devices="cpu").strategy
>>> all_reduce(single, 3, "sum"), all_gather(single, 2.5), broadcast(single, torch.ones(2), 0)
(3, tensor([2.5000], dtype=torch.float64), tensor([1., 1.]))

Tensors whose first dimension differs between ranks (a last evaluation batch) are gathered by
:func:`gather_rows` (padded to the longest for the collective, then cut back), which
``rt.gather_for_metrics`` uses; ``rt.all_gather`` refuses them on every rank, saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, get_args

import torch

from gpukit._util.text import described
from gpukit._util.tree import children, is_dataclass_instance, leaves, map_tensors
from gpukit.errors import ConfigError
from gpukit.strategies.base import ReduceOp, Strategy

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


def all_gather(strategy: Strategy, value: Any) -> Any:
    """Every rank's ``value`` in rank order, stacked on a new first dimension: a tensor's as a
    tensor of shape ``[world_size, *value.shape]`` on its device, a Python number's as a 1-D
    tensor of ``world_size`` numbers (int64 for an int or a bool, float64 for a float: exact)
    on the strategy's device, so ``all_gather(n).sum()`` works as it does on the tensors.
    Dicts, lists, tuples, namedtuples and dataclasses of them come back in the same structure,
    each tensor or number gathered so.

    Under several processes the ranks first exchange every leaf's path, kind, dtype and shape
    (one small object exchange): a difference is a ConfigError on every rank, where gathering
    tensors of different sizes would crash one rank and hand another a wrong result."""
    found = _gatherable(value)
    moved = [_on_device(strategy, leaf, "all_gather", False) for _, leaf in found]
    if strategy.distributed:
        mine = [
            (path, _kind(leaf), *_described_shape(t))
            for (path, leaf), (t, _) in zip(found, moved, strict=True)
        ]
        _check_alike(strategy.all_gather_object(mine))
    gathered = iter(
        back(strategy.all_gather(t)) if isinstance(leaf, torch.Tensor) else strategy.all_gather(t)
        for (_, leaf), (t, back) in zip(found, moved, strict=True)
    )
    return map_tensors(value, lambda _: next(gathered), leaf=_LEAVES, alias=False)


# What rt.all_gather gathers: tensors and Python numbers (bool is an int).
_LEAVES = (torch.Tensor, int, float)


def _gatherable(value: Any) -> list[tuple[str, Any]]:
    """The tensors and numbers inside ``value`` with their paths, in the order
    :func:`map_tensors` puts them back; anything else where a leaf goes is refused here, on
    the rank that holds it, before any exchange."""
    found = leaves(value, _LEAVES)  # first: a structure that holds itself is refused here
    if not isinstance(value, _LEAVES) and not _is_container(value):
        raise ConfigError(
            f"rt.all_gather got {described(value)}: give a tensor (on any device) or a Python "
            "number, or a dict, list or tuple of them"
        )
    for path, other in _others(value, "data"):
        raise ConfigError(
            f"rt.all_gather got {described(other)} at {path}: it gathers tensors and Python "
            "numbers (in dicts, lists, tuples, namedtuples and dataclasses); leave other "
            "values out of what you gather"
        )
    return found


def _others(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """What ``value`` holds that is neither a container nor a tensor or number."""
    if isinstance(value, _LEAVES):
        return
    if not _is_container(value):
        yield path, value
        return
    for name, child in children(value):
        yield from _others(child, path + name)


def _is_container(value: Any) -> bool:
    return isinstance(value, (list, tuple, Mapping)) or is_dataclass_instance(value)


def _kind(leaf: Any) -> str:
    return "tensor" if isinstance(leaf, torch.Tensor) else "number"


def _described_shape(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)


def _check_alike(everyone: list[list[tuple[str, str, str, tuple[int, ...]]]]) -> None:
    """ConfigError, on every rank alike, unless every rank gave the same structure with
    leaves of the same kind, dtype and shape."""
    paths = [[entry[0] for entry in rank] for rank in everyone]
    if any(p != paths[0] for p in paths):
        shown = "; ".join(f"rank {r}: {', '.join(p) or 'nothing'}" for r, p in enumerate(paths))
        raise ConfigError(
            f"rt.all_gather got a different structure on each rank ({shown}): give every rank "
            "the same dict, list or tuple, with the same keys and lengths"
        )
    for i, path in enumerate(paths[0]):
        entries = [rank[i] for rank in everyone]
        shapes: list[Shape] = [(str(d), tuple(int(n) for n in s)) for _, _, d, s in entries]
        if any(s != shapes[0] for s in shapes) or any(e[1] != entries[0][1] for e in entries):
            where = "" if path == "data" else f" at {path}"
            raise ConfigError(_uneven(shapes, entries[0][1] == "tensor", where))


Shape = tuple[str, tuple[int, ...]]


def exchange_shapes(strategy: Strategy, tensor: torch.Tensor) -> list[Shape]:
    """Every rank's (dtype, shape) of ``tensor``, in rank order: one object exchange (torch's
    ``all_gather_object``) under several processes, nothing alone."""
    mine: Shape = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
    if not strategy.distributed:
        return [mine]
    return [(str(d), tuple(int(n) for n in s)) for d, s in strategy.all_gather_object(mine)]


def gather_rows(strategy: Strategy, tensor: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """Every rank's ``tensor``, whose first dimension is ``rows[rank]`` (the other dimensions
    and the dtype alike on every rank, as the caller checked), in rank order, where ``tensor``
    was: padded to the longest along the first dimension for the collective, then cut back."""
    moved, back = _on_device(strategy, tensor, "gather_for_metrics", False)
    longest = max(rows)
    if moved.shape[0] < longest:
        filler = moved.new_zeros((longest - moved.shape[0], *moved.shape[1:]))
        moved = torch.cat([moved, filler])
    gathered = back(strategy.all_gather(moved))
    return [part[:n] for part, n in zip(gathered.unbind(0), rows, strict=True)]


def pad_across(
    strategy: Strategy, tensor: torch.Tensor, dim: int, pad_index: Number, pad_first: bool
) -> torch.Tensor:
    """``tensor`` padded with ``pad_index`` along ``dim`` to the longest size any rank has
    there (before its values with ``pad_first``), so that the ranks can gather it."""
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(
            f"rt.pad_across_processes got {described(tensor)}: give a tensor (for a dict or "
            "list of them, call it once per tensor)"
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ConfigError(
            f"rt.pad_across_processes(dim={described(dim)}): give the dimension to pad, an int"
        )
    if isinstance(pad_index, bool) or not isinstance(pad_index, int | float):
        raise ConfigError(
            f"rt.pad_across_processes(pad_index={described(pad_index)}): give the number to "
            "pad with, e.g. 0 or the tokenizer's pad token id"
        )
    # What depends on the tensor is checked after the exchange, so every rank decides alike.
    shapes = exchange_shapes(strategy, tensor)
    ndim = tensor.dim()
    if any(len(s) != ndim for _, s in shapes) or ndim == 0:
        shown = ", ".join(f"rank {r}: {s}" for r, (_, s) in enumerate(shapes))
        raise ConfigError(
            "rt.pad_across_processes pads one dimension of tensors with the same number of "
            f"dimensions (at least one) on every rank; got {shown}"
        )
    if not -ndim <= dim < ndim:
        raise ConfigError(
            f"rt.pad_across_processes(dim={dim}) for a tensor of shape {tuple(tensor.shape)}: "
            f"give a dimension from {-ndim} to {ndim - 1}"
        )
    dim = dim % ndim
    longest = max(s[dim] for _, s in shapes)
    missing = longest - tensor.shape[dim]
    if missing == 0:
        return tensor
    size = list(tensor.shape)
    size[dim] = missing
    filler = torch.full(size, pad_index, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)


def _uneven(shapes: list[Shape], is_tensor: bool, where: str = "") -> str:
    shown = ", ".join(f"rank {r}: {d} {s}" for r, (d, s) in enumerate(shapes))
    if not is_tensor:
        return (
            f"rt.all_gather got numbers of different kinds on different ranks{where} ({shown}): "
            "give every rank an int, or every rank a float"
        )
    first_only = all(
        d == shapes[0][0] and len(s) == len(shapes[0][1]) and s[1:] == shapes[0][1][1:]
        for d, s in shapes
    )
    if first_only and shapes[0][1]:
        fix = (
            "only the first dimension differs, as in a last evaluation batch: use "
            "rt.gather_for_metrics(x), which joins every rank's rows (and drops the samples "
            "the sampler repeated to even out the ranks), or rt.pad_across_processes(x) first"
        )
    else:
        fix = (
            "give every rank a tensor of the same dtype and shape (rt.pad_across_processes "
            "evens out one dimension)"
        )
    return f"rt.all_gather stacks one tensor per rank; they differ{where} ({shown}): {fix}"


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


@contextlib.contextmanager
def first_then_others(strategy: Strategy, first: bool) -> Iterator[None]:
    """The block run where ``first`` is true first, then on the other ranks
    (``rt.main_process_first``)."""
    if not first:
        strategy.barrier()  # wait until the first has done it
    try:
        yield
    finally:
        if first:
            # Even when the block failed: the others go on (and meet the same problem)
            # rather than wait in the barrier for the whole timeout.
            strategy.barrier()


def default_store() -> Any:
    """The process group's key-value store (preemption's agreement runs through it)."""
    return torch.distributed.distributed_c10d._get_default_store()
