"""The full weights of a sharded model, written as safetensors files one tensor at a time.

Gathering every weight onto rank 0 before writing needs the whole model in its host memory,
which a model larger than that memory does not fit. Here every rank gathers one tensor at a
time (``DTensor.full_tensor()``, a collective all join), and rank 0 writes it straight into
its place in the file and lets it go: rank 0 holds about one full tensor at once, whatever
the model's size. The files' headers are known before any value is (names, shapes and dtypes
are the same on every rank), so each file is written front to back in the format
safetensors reads (an 8-byte little-endian header length, the JSON header, the bytes).

A checkpoint written in the background (``async_save``) cannot gather on its thread: the
gathers are collectives of the training group, which training uses meanwhile. There
:func:`gather` copies the full weights to rank 0's host memory in the save (rank 0 then holds
the whole model there, as a save of whole weights does) and :func:`write` writes the same
files, byte for byte, from the thread.

Up to ``max_shard_bytes`` of weights go into one file, ``model.safetensors`` as for a model
that is not sharded. Beyond it the weights are split as Hugging Face splits them:
``model-00001-of-00003.safetensors``... with ``model.safetensors.index.json`` naming each
weight's file (``transformers`` and ``safetensors`` read both layouts). A tied weight is
written once, under the name safetensors itself keeps (the first in sorted order).

>>> plan([("a", 6), ("b", 6), ("c", 2)], 8)
[['a'], ['b', 'c']]
>>> shard_names("model.safetensors", 2)
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from gpukit.checkpoint import finite, snapshot
from gpukit.strategies import Strategy
from gpukit.strategies._fsdp_api import is_dtensor

MAX_SHARD_BYTES = 5 * 10**9  # what Hugging Face's save_pretrained puts in one file
INDEX = ".index.json"  # beside the shards: model.safetensors.index.json

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    **{
        getattr(torch, name): code
        for name, code in [("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")]
        if hasattr(torch, name)
    },
}


def tied_names(model: nn.Module) -> set[str]:
    """The names under which a weight shared with another name is not written (all but the
    first of each group in sorted order, as ``safetensors.torch.save_model`` keeps)."""
    names: dict[int, list[str]] = {}
    for name, value in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(value), []).append(name)
    return {name for group in names.values() for name in sorted(group)[1:]}


def plan(sizes: list[tuple[str, int]], cap: int) -> list[list[str]]:
    """The names of ``sizes`` (name, bytes, in order) split into files of at most ``cap``
    bytes each (a weight larger than ``cap`` gets a file of its own)."""
    files: list[list[str]] = [[]]
    held = 0
    for name, size in sizes:
        if files[-1] and held + size > cap:
            files.append([])
            held = 0
        files[-1].append(name)
        held += size
    return files


def shard_names(name: str, count: int) -> list[str]:
    """The files of ``count`` shards of the weights file ``name``; ``[name]`` for one."""
    if count == 1:
        return [name]
    stem = name.removesuffix(".safetensors")
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


@dataclass(frozen=True)
class _Layout:
    """How the full weights of a model are written: the files, the names in each (in the
    order written, the same on every rank), and the live values by name."""

    values: dict[str, Any]
    params: set[str]
    names: list[str]
    groups: list[list[str]]
    total: int


def _layout(model: nn.Module, name: str, max_shard_bytes: int) -> _Layout:
    tied = tied_names(model)
    values = {k: v for k, v in model.state_dict().items() if k not in tied}
    for key, value in values.items():
        if value.dtype not in _DTYPES:
            raise TypeError(f"{key} is {value.dtype}, which gpukit cannot export to safetensors")
    # Widest dtype first, then by name (as safetensors orders them): every offset is then a
    # multiple of its value's item size.
    order = sorted(values, key=lambda k: (-values[k].element_size(), k))
    sizes = [(k, values[k].numel() * values[k].element_size()) for k in order]
    groups = plan(sizes, max_shard_bytes)
    return _Layout(
        values=values,
        params={n for n, _ in model.named_parameters(remove_duplicate=False)},
        names=shard_names(name, len(groups)),
        groups=groups,
        total=sum(size for _, size in sizes),
    )


def export(
    model: nn.Module,
    strategy: Strategy,
    folder: Path,
    name: str,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    guard: Callable[[], Any] | None = None,
) -> tuple[list[str], list[str]]:
    """Write the full weights of the sharded ``model`` into ``folder`` as ``name`` (or its
    shards and index). Collective: every rank calls it and gives its shards of each weight in
    turn; rank 0 writes. Returns, on rank 0, the files written and the non-finite values
    found (buffers: NaN only); ``([], [])`` elsewhere.

    ``guard`` (rank 0): a context manager factory every write goes through (the checkpoint
    writer's, which notes a refused write); once a write failed rank 0 writes nothing more
    but still joins every gather, so no rank waits for it."""
    layout = _layout(model, name, max_shard_bytes)
    values = layout.values
    writing = strategy.rank == 0
    bad: list[str] = []
    written: list[str] = []
    for file, keys in zip(layout.names, layout.groups, strict=True):
        out: BinaryIO | None = None
        if writing:
            out = _attempt(guard, partial(_open, folder / file, keys, values))
        for key in keys:
            value = values[key]
            full = _gathered(value) if is_dtensor(value) else value  # every rank joins
            if out is None:
                continue
            host = full.detach().to("cpu").contiguous()
            bad += finite.problems([(file, key, host, key not in layout.params)])
            if _attempt(guard, partial(_write, out, host)) is None:
                out.close()
                out = None
            del full, host
        if out is not None:
            out.close()
            written.append(file)
    indexed = writing and len(layout.names) > 1 and len(written) == len(layout.names)
    if indexed and _attempt(guard, partial(_dump, folder / (name + INDEX), _index(layout))):
        written.append(name + INDEX)
    return written, bad


@dataclass(frozen=True)
class Gathered:
    """Rank 0's copy in host memory of a sharded model's full weights, to be written as
    :func:`export` writes them (see :func:`gather` and :func:`write`)."""

    name: str
    layout: _Layout  # its ``values`` are the host copies


def gather(
    model: nn.Module, strategy: Strategy, name: str, *, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Gathered | None:
    """The full weights of the sharded ``model`` copied to rank 0's host memory, for
    :func:`write` to write later (a checkpoint written in the background); None on the
    other ranks. Collective, as :func:`export`, in the same order; rank 0 then holds the
    whole model in host memory (one full tensor at a time on its device). On a GPU the
    copies are enqueued: ``snapshot.wait_copies`` before reading them."""
    layout = _layout(model, name, max_shard_bytes)
    copies: dict[str, Any] = {}
    for keys in layout.groups:
        for key in keys:
            value = layout.values[key]
            full = _gathered(value) if is_dtensor(value) else value  # every rank joins
            if strategy.rank == 0:
                # A copy even on a CPU: one rank's gather may return the live tensor, which
                # training changes in place.
                copies[key] = snapshot.host_copy(full)
            del full
    if strategy.rank != 0:
        return None
    return Gathered(name, replace(layout, values=copies))


def write(gathered: Gathered, folder: Path) -> tuple[list[str], list[str]]:
    """Write what :func:`gather` copied into ``folder``, in the files :func:`export` writes,
    byte for byte; returns the files written and the non-finite values found."""
    layout = gathered.layout
    bad: list[str] = []
    for file, keys in zip(layout.names, layout.groups, strict=True):
        with _open(folder / file, keys, layout.values) as out:
            for key in keys:
                host = layout.values[key].contiguous()
                bad += finite.problems([(file, key, host, key not in layout.params)])
                _write(out, host)
    written = list(layout.names)
    if len(layout.names) > 1:
        _dump(folder / (gathered.name + INDEX), _index(layout))
        written.append(gathered.name + INDEX)
    return written, bad


def _index(layout: _Layout) -> dict[str, Any]:
    """``model.safetensors.index.json``: the total size and each weight's file."""
    return {
        "metadata": {"total_size": layout.total},
        "weight_map": {
            k: f for f, keys in zip(layout.names, layout.groups, strict=True) for k in sorted(keys)
        },
    }


def _gathered(value: Any) -> torch.Tensor:
    """The full tensor of the DTensor ``value`` (collective). A shard kept off its mesh's
    device (fsdp's CPU offload under nccl) goes there first, as torch's own full state dict
    does: the collective runs on the mesh's device."""
    kind = value.device_mesh.device_type
    if value.device.type != kind:
        value = value.to(kind)
    return value.full_tensor()


def _attempt(guard: Callable[[], Any] | None, fn: Callable[[], Any]) -> Any:
    """``fn()``, inside ``guard()`` when given; None when the guard swallowed its error."""
    if guard is None:
        return fn()
    result = None
    with guard():
        result = fn()
    return result


def _open(path: Path, keys: list[str], values: dict[str, Any]) -> BinaryIO:
    """``path`` opened with its safetensors header written: the values' bytes follow, in
    ``keys``' order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    start = 0
    for key in keys:
        value = values[key]
        end = start + value.numel() * value.element_size()
        header[key] = {
            "dtype": _DTYPES[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [start, end],
        }
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the bytes start 8-aligned, as safetensors writes them
    out = path.open("wb")
    try:
        out.write(struct.pack("<Q", len(text)) + text)
    except BaseException:
        out.close()
        raise
    return out


def _write(out: BinaryIO, host: torch.Tensor) -> bool:
    """The bytes of ``host`` (a contiguous CPU tensor) appended to ``out``, without a copy."""
    if host.numel():
        out.write(host.reshape(-1).view(torch.uint8).numpy().data)
    return True


def _dump(path: Path, index: dict[str, Any]) -> bool:
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return True
