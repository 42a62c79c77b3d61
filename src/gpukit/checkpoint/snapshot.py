"""A copy in host memory of what a checkpoint writes, taken between two steps, so that a
background thread can write it while training changes the originals.

On CUDA the copies go to pinned memory, enqueued without waiting, then one synchronisation
before the thread reads them; on a CPU each tensor's bytes are copied by one thread (training
changes parameters in place, so a view would not do). The weights are laid out as
``safetensors.torch.save_model`` lays them out (tied weights once, the other names in the
metadata, contiguous), so that the file written from the copy holds the same bytes.

A :class:`HostBuffers` keeps the copies of one save for the next (``async_save``): a save
copies into the memory the previous one wrote from, once that write has ended, and allocates
only for tensors that are new or changed shape (a fresh allocation touches every page; pinned
memory is slow to allocate). The memory of one checkpoint stays held between saves.

>>> import torch
>>> copied, metadata = weights(torch.nn.Linear(2, 1))
>>> sorted(copied), metadata
(['bias', 'weight'], None)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from safetensors.torch import _remove_duplicate_names  # save_model's own rule for tied names

from gpukit._util.tree import map_tensors
from gpukit.strategies._fsdp_api import is_dtensor

Copy = Callable[[torch.Tensor], torch.Tensor]  # a tensor to its copy in host memory
# What a buffer fits: the shape, the dtype, and whether it is pinned (copies from a GPU).
_Fit = tuple[tuple[int, ...], torch.dtype, bool]


def host_copy(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor``'s values in host memory: ``out`` (contiguous, of its shape and dtype), else
    new memory, pinned when it lives on a GPU (the copy is then enqueued: call
    :func:`wait_copies` before reading it). A DTensor (an fsdp shard) stays one, its local
    shard copied into new memory: torch.distributed.checkpoint writes it where it belongs."""
    tensor = tensor.detach()
    if is_dtensor(tensor):
        # DTensor's own copy keeps its mesh and placements; from a GPU, non_blocking puts the
        # copy in pinned memory, as torch's own staging for asynchronous saves does.
        return tensor.to("cpu", copy=True, non_blocking=tensor.device.type != "cpu")
    pinned = _pinned(tensor)
    if out is None:
        if tensor.device.type == "cpu":
            return tensor.clone(memory_format=torch.contiguous_format)
        out = _empty(tensor)
    if tensor.device.type == "cpu" and _plain_bytes(tensor):
        # One thread's memcpy: copy_ splits a large copy over the intra-op threads, which on
        # a CPU that other processes keep busy wait for each other (measured: 48 MiB in
        # 140 ms on two such cores, against 9 ms for one thread). Bitwise the same values.
        np.copyto(_bytes(out), _bytes(tensor))
    else:
        out.copy_(tensor, non_blocking=pinned)
    return out


def _empty(tensor: torch.Tensor) -> torch.Tensor:
    """New host memory for a copy of ``tensor`` (pinned when it comes from a GPU)."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=_pinned(tensor))


def _plain_bytes(tensor: torch.Tensor) -> bool:
    """``tensor``'s values are its bytes, in order (no lazy conjugate or negation)."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous host tensor, as numpy sees them (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class HostBuffers:
    """The host copies of the last background save, kept for the next (see the module
    docstring). Each save takes a :class:`Lease`; the buffers it used come back when its
    write ends (:meth:`Lease.give_back`), so that no save ever copies into memory a write
    still reads: a lease taken while the last one is out (a write abandoned at a stop)
    allocates afresh.

    >>> buffers = HostBuffers()
    >>> first = buffers.lease()
    >>> a = first.copy(torch.ones(3))
    >>> first.give_back()
    >>> second = buffers.lease()
    >>> second.copy(torch.zeros(3)).data_ptr() == a.data_ptr(), a.tolist()
    (True, [0.0, 0.0, 0.0])
    """

    def __init__(self) -> None:
        self._free: dict[_Fit, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # a write's thread gives back while a save may lease

    def lease(self) -> Lease:
        """The buffers of the last save whose write ended, for one save to copy into."""
        with self._lock:
            free, self._free = self._free, {}
        return Lease(self, free)

    def clear(self) -> None:
        """Free the buffers kept (the end of the run)."""
        with self._lock:
            self._free = {}

    @property
    def held(self) -> list[torch.Tensor]:
        """The buffers kept for the next save."""
        with self._lock:
            return [t for kept in self._free.values() for t in kept]

    def _returned(self, used: dict[_Fit, list[torch.Tensor]]) -> None:
        with self._lock:
            # The last save's buffers only: one that no tensor fitted any more is let go.
            self._free = used


class Lease:
    """One save's copies (see :class:`HostBuffers`): :meth:`copy` hands each tensor a buffer
    of its shape and dtype the last save used, or new memory; never one buffer to two."""

    def __init__(self, owner: HostBuffers, free: dict[_Fit, list[torch.Tensor]]) -> None:
        self._owner = owner
        self._free = free
        self._used: dict[_Fit, list[torch.Tensor]] = {}
        self._given_back = False

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in host memory, as :func:`host_copy` gives them."""
        assert not self._given_back, "a copy into buffers already given back"
        plain = tensor.detach()
        # Only plain dense tensors: the others are copied as host_copy copies them.
        if type(plain) is not torch.Tensor or plain.layout != torch.strided or plain.is_quantized:
            return host_copy(plain)
        fit = (tuple(plain.shape), plain.dtype, _pinned(plain))
        kept = self._free.get(fit)
        out = host_copy(plain, kept.pop(0) if kept else _empty(plain))
        self._used.setdefault(fit, []).append(out)
        return out

    def give_back(self) -> None:
        """Nothing reads the copies any more (their write ended, or never began): the next
        save may copy into them."""
        assert not self._given_back, "buffers given back twice"
        self._given_back = True
        self._owner._returned(self._used)
        self._used, self._free = {}, {}  # the ones no tensor fitted go now, not with the lease


def _pinned(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s host copy is pinned: it comes from a GPU (a non-blocking copy)."""
    return tensor.device.type != "cpu" and torch.cuda.is_available()


def wait_copies(device: torch.device) -> None:
    """The copies :func:`host_copy` enqueued from ``device`` are done (one synchronisation
    per save, none on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def weights(
    model: torch.nn.Module, copy: Copy = host_copy
) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """``model``'s state as ``save_model`` writes it, copied to host memory by ``copy``: the
    tensors and the metadata naming the tied names it leaves out."""
    state = model.state_dict()
    metadata: dict[str, str] | None = None
    for kept, removed in _remove_duplicate_names(state).items():
        for name in removed:
            metadata = metadata or {}
            metadata.setdefault(name, kept)
            del state[name]
    return {name: copy(t) for name, t in state.items()}, metadata


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


def tree(obj: Any, copy: Copy = host_copy) -> Any:
    """``obj`` (the progress: optimizer state, loaders, RNG states) with every tensor copied to
    host memory by ``copy``; tensors shared between places stay shared."""
    return map_tensors(obj, copy)
