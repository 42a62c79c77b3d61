"""A copy in host memory of what a checkpoint writes, taken between two steps, so that a
background thread can write it while training changes the originals.

On CUDA the copies go to pinned memory, enqueued without waiting, then one synchronisation
before the thread reads them; on a CPU each tensor is cloned (training changes parameters in
place, so a view would not do). The weights are laid out as ``safetensors.torch.save_model``
lays them out (tied weights once, the other names in the metadata, contiguous), so that the
file written from the copy holds the same bytes.

>>> import torch
>>> copied, metadata = weights(torch.nn.Linear(2, 1))
>>> sorted(copied), metadata
(['bias', 'weight'], None)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import _remove_duplicate_names  # save_model's own rule for tied names

from gpukit._util.tree import map_tensors
from gpukit.strategies._fsdp_api import is_dtensor


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in new host memory (pinned when it lives on a GPU; the copy is
    enqueued: call :func:`wait_copies` before reading it). A DTensor (an fsdp shard) stays
    one, its local shard copied: torch.distributed.checkpoint writes it where it belongs."""
    tensor = tensor.detach()
    if is_dtensor(tensor):
        # DTensor's own copy keeps its mesh and placements; from a GPU, non_blocking puts the
        # copy in pinned memory, as torch's own staging for asynchronous saves does.
        return tensor.to("cpu", copy=True, non_blocking=tensor.device.type != "cpu")
    if tensor.device.type == "cpu":
        return tensor.clone(memory_format=torch.contiguous_format)
    pinned = torch.cuda.is_available()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
    out.copy_(tensor, non_blocking=pinned)
    return out


def wait_copies(device: torch.device) -> None:
    """The copies :func:`host_copy` enqueued from ``device`` are done (one synchronisation
    per save, none on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``model``'s state as ``save_model`` writes it, copied to host memory: the tensors and
    the metadata naming the tied names it leaves out."""
    state = model.state_dict()
    metadata: dict[str, str] | None = None
    for kept, removed in _remove_duplicate_names(state).items():
        for name in removed:
            metadata = metadata or {}
            metadata.setdefault(name, kept)
            del state[name]
    return {name: host_copy(t) for name, t in state.items()}, metadata


def named(
    order: Iterable[str], tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> dict[str, torch.Tensor]:
    """The copies under every name in ``order`` (the model's state's), tied names included:
    for checks that name each, as they would name the live tensors.

    >>> list(named(["b", "a"], {"a": torch.zeros(1)}, {"b": "a"}))
    ['b', 'a']
    """
    tied = metadata or {}
    return {name: tensors[name] if name in tensors else tensors[tied[name]] for name in order}


def tree(obj: Any) -> Any:
    """``obj`` (the progress: optimizer state, loaders, RNG states) with every tensor copied to
    host memory; tensors shared between places stay shared."""
    return map_tensors(obj, host_copy)
