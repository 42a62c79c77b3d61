"""What a model and its optimizer hold, in bytes: parameters, gradients, optimizer state and
buffers, per device, each piece of memory counted once (``gk.memory.breakdown``).

>>> from torch import nn
>>> breakdown(nn.Linear(2, 2)).total  # (2 * 2 + 2) float32
24
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer

from gpukit._util import tree
from gpukit._util.text import format_bytes, make_table, render_plain
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor

CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes of a model's parameters, gradients, optimizer state and buffers, per device.

    The counts are what this process holds. When tensors are sharded over ranks (DTensors,
    under fsdp), ``unsharded`` gives each category's size with every sharded tensor counted
    whole, as one process would hold it without sharding; it is None when nothing is sharded.

    >>> b = MemoryBreakdown(40, 40, 84, 0, {"cpu": dict(parameters=40, gradients=40,
    ...                     optimizer_state=84, buffers=0)})
    >>> b.total, b.unsharded
    (164, None)
    """

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int
    by_device: dict[str, dict[str, int]]
    unsharded: dict[str, int] | None = None

    @property
    def total(self) -> int:
        """All four categories together."""
        return self.parameters + self.gradients + self.optimizer_state + self.buffers

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the four totals, ``total``, ``by_device`` and ``unsharded``."""
        return {**dataclasses.asdict(self), "total": self.total}

    def __str__(self) -> str:
        header = ["device", "parameters", "gradients", "optimizer state", "buffers", "total"]
        items = list(self.by_device.items())
        if len(items) != 1:  # one device: its row is already the total
            items.append(("total", {c: getattr(self, c) for c in CATEGORIES}))
        title = "Memory breakdown"
        if self.unsharded is not None:
            items = [(f"{name} (this rank)", v) for name, v in items]
            items.append(("unsharded (full size)", self.unsharded))
            title += ": this rank's shards, and the full size without sharding"
        rows = [
            [name, *(format_bytes(v[c]) for c in CATEGORIES), format_bytes(sum(v.values()))]
            for name, v in items
        ]
        return render_plain(make_table(title, header, rows))


def breakdown(model: nn.Module, optimizer: Optimizer | None = None) -> MemoryBreakdown:
    """What a model and its optimizer hold, in bytes, per category and device.

    Each piece of memory counts once: tied weights, and tensors that share memory, under
    the first category that holds them (parameters, gradients, buffers, optimizer state).
    Meta tensors count the bytes they would take, which sizes a model without allocating it.
    A sharded tensor (a DTensor, as fsdp makes parameters, gradients and optimizer state)
    counts the shard this rank holds; ``unsharded`` adds up their full sizes. Each rank
    calls it for its own numbers (no collective).

    >>> import torch
    >>> with torch.device("meta"):
    ...     big = torch.nn.Linear(1000, 1000)
    >>> breakdown(big).parameters  # (1000 * 1000 + 1000) float32
    4004000
    """
    checks: list[tuple[str, object, Any, str]] = [
        ("model", model, nn.Module, "an nn.Module"),
        ("optimizer", optimizer, (Optimizer, type(None)), "a torch.optim.Optimizer"),
    ]
    for name, value, kind, allowed in checks:
        if not isinstance(value, kind):
            raise ConfigError(
                f"breakdown() got a {type(value).__name__} as {name}: pass {allowed} "
                "(e.g. gk.memory.breakdown(model, optimizer); the optimizer may be left out)"
            )
    sources: dict[str, Iterable[torch.Tensor]] = {
        "parameters": list(model.parameters()),
        "gradients": [p.grad for p in model.parameters() if p.grad is not None],
        "buffers": list(model.buffers()),
        "optimizer_state": tree.tensors(optimizer.state if optimizer is not None else {}),
    }
    seen: set[tuple[str, int, int]] = set()
    by_device: dict[str, dict[str, int]] = {}
    unsharded = dict.fromkeys(CATEGORIES, 0)
    sharded = False
    for category, tensors in sources.items():
        for t in tensors:
            full = t.nelement() * t.element_size()  # a DTensor's numel() is the global one
            if is_dtensor(t):
                sharded = True
                t = cast(Any, t).to_local()
            nbytes = t.nelement() * t.element_size()
            # Meta tensors all sit at address 0: only their identity tells them apart.
            key = (str(t.device), id(t) if t.is_meta else t.data_ptr(), nbytes)
            if key not in seen:
                seen.add(key)
                by_device.setdefault(key[0], dict.fromkeys(CATEGORIES, 0))[category] += nbytes
                unsharded[category] += full
    totals = {c: sum(v[c] for v in by_device.values()) for c in CATEGORIES}
    return MemoryBreakdown(
        **totals,
        by_device=dict(sorted(by_device.items())),
        unsharded=unsharded if sharded else None,
    )
