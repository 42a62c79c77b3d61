"""Where a model's parameters and buffers live: a per-device report.

>>> import torch, gpukit as gk
>>> report = gk.placement(torch.nn.Linear(4, 2))
>>> report.to_dict()["devices"]["cpu"]["parameters"]
{'count': 2, 'elements': 10, 'bytes': 40}
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import nn

from gpukit._util import tree
from gpukit._util.text import format_bytes, type_name
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor

Role = Literal["parameters", "buffers", "tensors"]
ROLES: tuple[Role, ...] = ("parameters", "buffers", "tensors")


@dataclass
class _Tally:
    count: int = 0
    elements: int = 0
    bytes: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.count += 1
        self.elements += t.numel()
        self.bytes += t.numel() * t.element_size()


@dataclass(frozen=True)
class ShardedTensor:
    """A parameter or buffer split over ranks (a DTensor, as fsdp makes them): how it is
    placed over the mesh, the shape this rank holds and the whole one.

    >>> ShardedTensor("fc.weight", "Shard(0)", (2,), (3, 4), (6, 4), 48, 96).layout
    'Shard(0) over 2 ranks'
    """

    name: str
    placements: str  # one per mesh dimension, e.g. "Shard(0)" or "Replicate(), Shard(0)"
    mesh: tuple[int, ...]  # ranks along each mesh dimension
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    local_bytes: int
    global_bytes: int

    @property
    def layout(self) -> str:
        """The placements and the ranks they span, in words."""
        ranks = " x ".join(map(str, self.mesh))
        return f"{self.placements} over {ranks} rank{'s' if self.mesh != (1,) else ''}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields by name, shapes as lists."""
        return {
            "name": self.name,
            "placements": self.placements,
            "mesh": list(self.mesh),
            "local_shape": list(self.local_shape),
            "global_shape": list(self.global_shape),
            "local_bytes": self.local_bytes,
            "global_bytes": self.global_bytes,
        }


@dataclass(frozen=True)
class SplitModule:
    """A module whose tensors span devices: where the split happens, and what sits where."""

    module: str  # qualified name; "" is the model itself
    parts: dict[str, list[str]]  # device -> child modules and own tensors on it

    @property
    def devices(self) -> list[str]:
        return sorted(self.parts)


@dataclass
class PlacementReport:
    """Per device, how many parameters, buffers and loose tensors, and their bytes. For
    sharded tensors (DTensors) the tallies count what this rank holds, and ``sharded`` lists
    each one with its placement, local and global shape."""

    title: str
    tallies: dict[str, dict[Role, _Tally]] = field(default_factory=dict)
    split: list[SplitModule] = field(default_factory=list)
    sharded: list[ShardedTensor] = field(default_factory=list)

    @property
    def devices(self) -> list[str]:
        """The devices holding any tensor, in a stable order."""
        return sorted(self.tallies)

    def total_bytes(self, dev: str) -> int:
        return sum(t.bytes for t in self.tallies[dev].values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"devices": {dev: {role: {count, elements, bytes}, "total_bytes"}},
        "split_modules": [{"module", "devices", "parts"}]}``."""
        return {
            "title": self.title,
            "devices": {
                dev: {
                    **{role: vars(self.tallies[dev][role]).copy() for role in ROLES},
                    "total_bytes": self.total_bytes(dev),
                }
                for dev in self.devices
            },
            "split_modules": [
                {"module": s.module or "(model)", "devices": s.devices, "parts": s.parts}
                for s in self.split
            ],
            "sharded": [t.to_dict() for t in self.sharded],
        }

    def __str__(self) -> str:
        from gpukit._util.text import render_table

        used = [r for r in ROLES if any(self.tallies[d][r].count for d in self.devices)]
        header = ["device"] + [h for r in used for h in (r, f"{r} bytes")] + ["total"]
        rows = [
            [dev]
            + [
                v
                for r in used
                for v in (str(self.tallies[dev][r].count), format_bytes(self.tallies[dev][r].bytes))
            ]
            + [format_bytes(self.total_bytes(dev))]
            for dev in self.devices
        ]
        text = render_table(f"Placement of {self.title}", header, rows)
        for s in self.split:
            where = "; ".join(f"{dev}: {', '.join(names)}" for dev, names in s.parts.items())
            text += f"\nsplit across devices: {s.module or '(model)'} -> {where}"
        if self.sharded:
            header = ["tensor", "placement", "this rank", "whole", "this rank bytes", "whole bytes"]
            rows = [
                [
                    t.name,
                    t.layout,
                    _shape(t.local_shape),
                    _shape(t.global_shape),
                    format_bytes(t.local_bytes),
                    format_bytes(t.global_bytes),
                ]
                for t in self.sharded
            ]
            text += "\n" + render_table(
                "Sharded tensors (the counts above are this rank's)", header, rows
            )
        return text


def placement(obj: nn.Module | torch.Tensor | Any) -> PlacementReport:
    """Report where the tensors of a model live, or those of a tensor or of nested data (dicts,
    lists, tuples, namedtuples, dataclasses) holding them.

    Warns when a model spans several devices, and names the modules where the split happens:
    a layer whose own weight and bias differ is usually a bug; a model whose halves sit on two
    GPUs is model parallelism on purpose.

    >>> import torch, gpukit as gk
    >>> print(gk.placement({"x": torch.ones(2, 2)}))  # doctest: +SKIP
    """
    if isinstance(obj, nn.Module):
        report = PlacementReport(type(obj).__name__)
        for name, p in obj.named_parameters():
            _tally(report, "parameters", p, name)
        for name, b in obj.named_buffers():
            _tally(report, "buffers", b, name)
        report.split = _split_modules(obj)
        if report.split:
            warnings.warn(
                f"{report.title} is split across devices {', '.join(report.devices)}; "
                "ops between the parts copy data (see gk.placement(model) for where)",
                stacklevel=2,
            )
        return report
    tensors = list(tree.tensors(obj))
    if not tensors and not isinstance(obj, (dict, list, tuple)):
        raise ConfigError(
            f"gk.placement() got a {type_name(obj)}: pass an nn.Module, a tensor, "
            "or a dict/list/tuple of tensors"
        )
    report = PlacementReport(type(obj).__name__)
    for t in tensors:
        _tally(report, "tensors", t)
    return report


def _tally(report: PlacementReport, role: Role, t: torch.Tensor, name: str = "") -> None:
    if is_dtensor(t):
        report.sharded.append(_sharded(name or f"{role}[{len(report.sharded)}]", t))
        # What this rank holds: a DTensor's numel() is the whole tensor's.
        t = cast(Any, t).to_local()
    dev = str(t.device)
    if dev not in report.tallies:
        report.tallies[dev] = {r: _Tally() for r in ROLES}
    report.tallies[dev][role].add(t)


def _sharded(name: str, t: Any) -> ShardedTensor:
    local = t.to_local()
    return ShardedTensor(
        name=name,
        placements=", ".join(_placement(p) for p in t.placements),
        mesh=tuple(t.device_mesh.shape),
        local_shape=tuple(local.shape),
        global_shape=tuple(t.shape),
        local_bytes=local.numel() * local.element_size(),
        global_bytes=t.numel() * t.element_size(),
    )


def _placement(p: Any) -> str:
    # Spelled as the classes are written in code (this torch prints Shard(0) as "S(0)").
    if p.is_shard():
        return f"Shard({p.dim})"
    return "Replicate()" if p.is_replicate() else "Partial()" if p.is_partial() else str(p)


def _shape(shape: tuple[int, ...]) -> str:
    return str(tuple(shape))


def _split_modules(model: nn.Module) -> list[SplitModule]:
    """The deepest modules whose subtree spans devices: exactly where each split happens."""
    subtree: dict[int, set[str]] = {}  # id(module) -> devices of its subtree, filled bottom-up

    def devices_of(module: nn.Module) -> set[str]:
        if id(module) not in subtree:
            own = {str(t.device) for t in _own_tensors(module).values()}
            subtree[id(module)] = own.union(*(devices_of(c) for c in module.children()))
        return subtree[id(module)]

    found = []
    for name, module in model.named_modules():
        if len(devices_of(module)) < 2 or any(len(devices_of(c)) > 1 for c in module.children()):
            continue  # not split here, or split further down
        parts: dict[str, list[str]] = {}
        for child_name, child in module.named_children():
            for dev in sorted(devices_of(child)):
                parts.setdefault(dev, []).append(child_name)
        for tensor_name, t in _own_tensors(module).items():
            parts.setdefault(str(t.device), []).append(tensor_name)
        found.append(SplitModule(name, dict(sorted(parts.items()))))
    return found


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **dict(module.named_parameters(recurse=False)),
        **dict(module.named_buffers(recurse=False)),
    }
