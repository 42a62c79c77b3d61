"""Weights from safetensors files (a pretrained model's, or gpukit's own exports) loaded into a
model that is set up, each rank reading only the part it keeps.

A model built on the meta device and sharded by fsdp never exists whole on a rank; loading a
full state dict into it would bring it back whole. Here every weight is read from its file on
its own: a tensor sharded by rows (FSDP2's layout) reads only this rank's rows from the file
(safetensors reads a slice without the rest), any other layout reads the tensor and keeps its
part (one full tensor at a time), a plain tensor is copied whole. The files are ``path`` itself
(one ``.safetensors`` file), or a folder's ``*.safetensors.index.json`` (Hugging Face's split
layout, which names each weight's file), or else every ``*.safetensors`` file in the folder.

Names are the model's ``state_dict`` names. A weight shared by several names (a head tied to its
embedding) is filled from whichever name a file holds. Every name and shape is checked before
any value is read, so a mismatch changes nothing; values are cast to the model's dtypes as
``load_state_dict`` casts them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies.meta_init import keep_shard

INDEX_SUFFIX = ".safetensors.index.json"


def weight_files(path: str | Path) -> dict[str, Path]:
    """Each weight's name in the files at ``path`` and the file that holds it."""
    root = Path(path)
    if root.is_file() and root.name.endswith(INDEX_SUFFIX):
        return _indexed(root)
    if root.is_file():
        files = [root]
    elif root.is_dir():
        indexes = sorted(root.glob(f"*{INDEX_SUFFIX}"))
        if indexes:
            return _indexed(indexes[0])
        files = sorted(root.glob("*.safetensors"))
    else:
        raise ConfigError(
            f"rt.load_weights: {str(root)!r} does not exist: give a .safetensors "
            "file or a folder holding them"
        )
    if not files:
        raise ConfigError(
            f"rt.load_weights: {str(root)!r} holds no .safetensors file (nor an index "
            f"*{INDEX_SUFFIX}): give the file, or the folder save_pretrained or gpukit wrote"
        )
    found: dict[str, Path] = {}
    for file in files:
        with opened_file(file) as handle:
            for name in handle.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if name in found:
                    raise ConfigError(
                        f"rt.load_weights: {name!r} is in both {found[name].name} and "
                        f"{file.name}: give one file, or a folder with an index"
                    )
                found[name] = file
    return found


def _indexed(index: Path) -> dict[str, Path]:
    """The weight map of Hugging Face's index file, every file it names checked to be there
    (a shard missing would otherwise surface halfway through the load)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        where = {str(name): index.parent / str(file) for name, file in weight_map.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"rt.load_weights: {str(index)!r} is not a safetensors index ({err!r}): it must "
            'be JSON with a "weight_map" of weight name to file, as save_pretrained writes '
            "it; write it again, or give the .safetensors file itself"
        ) from None
    absent = sorted({file.name for file in where.values() if not file.is_file()})
    if absent:
        raise ConfigError(
            f"rt.load_weights: the index {str(index)!r} names {_some(absent)} file(s) not in "
            f"{str(index.parent)!r}: copy the missing shards there (a download stopped "
            "halfway?), or give a folder holding every file its index names"
        )
    return where


@contextlib.contextmanager
def opened_file(file: Path) -> Iterator[Any]:
    """``safe_open`` on ``file``, its refusal (not safetensors, cut short) said with the name
    of the file: the library's own message names neither the file nor what to do."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        raise ConfigError(
            f"rt.load_weights: {str(file)!r} is not a readable safetensors file ({err}): "
            "it is another format, or was cut short (a copy or download that stopped); "
            "write or download it again, or give the .safetensors file the model was saved to"
        ) from None
    with handle as opened:
        yield opened


def load_weights(model: nn.Module, path: str | Path, *, strict: bool = True) -> dict[str, Any]:
    """Fill ``model``'s weights (its ``state_dict`` names) from the safetensors files at
    ``path`` (see the module doc); returns what was loaded and what was left."""
    where = weight_files(path)
    slots = model.state_dict(keep_vars=True)
    shared: dict[int, list[str]] = {}
    for name, tensor in slots.items():
        shared.setdefault(id(tensor), []).append(name)
    missing = [names[0] for names in shared.values() if not any(n in where for n in names)]
    unexpected = sorted(set(where) - set(slots))
    if strict and (missing or unexpected):
        raise ConfigError(
            f"rt.load_weights: the files at {str(path)!r} do not match the model: "
            f"{_some(missing)} missing, {_some(unexpected)} unexpected. Check that the files "
            "are this model's (the names are its state_dict's), or pass strict=False to load "
            "the names both have"
        )
    chosen = [
        (next(n for n in names if n in where), names)
        for names in shared.values()
        if any(n in where for n in names)
    ]
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def opened(file: Path) -> Any:
            if file not in handles:
                handles[file] = stack.enter_context(opened_file(file))
            return handles[file]

        for name, names in chosen:  # every shape first: a mismatch must change nothing
            shape = tuple(opened(where[name]).get_slice(name).get_shape())
            if shape != tuple(slots[names[0]].shape):
                raise ConfigError(
                    f"rt.load_weights: {name!r} is {list(shape)} in {where[name].name} but "
                    f"{list(slots[names[0]].shape)} in the model: the files are another "
                    "model's, or another size of it"
                )
        with torch.no_grad():
            for name, names in chosen:
                _fill(slots[names[0]], opened(where[name]), name)
    return {
        "loaded": len(chosen),
        "files": len(set(where.values())),
        "missing": missing,
        "unexpected": unexpected,
    }


def _fill(target: torch.Tensor, handle: Any, name: str) -> None:
    """Copy weight ``name`` of the file into ``target``: this rank's rows when ``target`` is
    sharded by rows, else its part of the whole tensor."""
    if not is_dtensor(target):
        target.copy_(handle.get_tensor(name))
        return
    rows = _my_rows(target)
    if rows is not None:
        start, stop = rows
        local = getattr(target, "to_local")()  # noqa: B009  (a DTensor's)
        if stop > start:
            local.copy_(handle.get_slice(name)[start:stop])
        return
    keep_shard(target, handle.get_tensor(name))


def _my_rows(target: Any) -> tuple[int, int] | None:
    """The rows of the full tensor this rank keeps when ``target`` is sharded along dim 0 of
    a one-dimensional mesh as torch.chunk splits it (FSDP2's layout); None for other layouts."""
    from torch.distributed.tensor import Shard

    mesh, placements = target.device_mesh, tuple(target.placements)
    if mesh.ndim != 1 or placements != (Shard(0),) or target.dim() == 0:
        return None
    rows, ranks = target.shape[0], mesh.size()
    chunk = -(-rows // ranks)
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    if target.to_local().shape[0] != stop - start:  # not torch.chunk's split: read it all
        return None
    return start, stop


def _some(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:5])
    return f"{len(names)} ({shown}{', ...' if len(names) > 5 else ''})"
