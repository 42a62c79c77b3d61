"""Where a model's parameters and buffers live: a per-device report.

>>> import torch, gpukit as gk
>>> report = gk.placement(torch.nn.Linear(4, 2))
>>> report.to_dict()["devices"]["cpu"]["parameters"]
{'count': 2, 'elements': 10, 'bytes': 40}
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from gpukit._util import tree
from gpukit._util.text import format_bytes, type_name
from gpukit.errors import ConfigError

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
class SplitModule:
    """A module whose tensors span devices: where the split happens, and what sits where."""

    module: str  # qualified name; "" is the model itself
    parts: dict[str, list[str]]  # device -> child modules and own tensors on it

    @property
    def devices(self) -> list[str]:
        return sorted(self.parts)


@dataclass
class PlacementReport:
    """Per device, how many parameters, buffers and loose tensors, and their bytes."""

    title: str
    tallies: dict[str, dict[Role, _Tally]] = field(default_factory=dict)
    split: list[SplitModule] = field(default_factory=list)

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
        for _, p in obj.named_parameters():
            _tally(report, "parameters", p)
        for _, b in obj.named_buffers():
            _tally(report, "buffers", b)
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


def _tally(report: PlacementReport, role: Role, t: torch.Tensor) -> None:
    dev = str(t.device)
    if dev not in report.tallies:
        report.tallies[dev] = {r: _Tally() for r in ROLES}
    report.tallies[dev][role].add(t)


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
