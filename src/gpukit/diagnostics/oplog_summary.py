"""What a placement log found, summarised: ops per device, CPU ops under an accelerator model,
cross-device copies, ops whose inputs mixed devices (see ``gpukit.diagnostics.oplog``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpukit._util.text import format_bytes


@dataclass
class ModuleStats:
    """Per module (level="module"): calls, own ops per device, devices of inputs and outputs."""

    name: str
    type: str
    calls: int = 0
    ops: dict[str, int] = field(default_factory=dict)  # ops of this module, not of its children
    inputs: set[str] = field(default_factory=set)
    outputs: set[str] = field(default_factory=set)


@dataclass
class PlacementSummary:
    """Ops per device, CPU ops under an accelerator model, cross-device copies, mixed inputs.

    ``cpu_ops``: ``[{op, module, count}]``, ``copies``: ``[{op, src, dst, count, bytes}]``,
    ``mixed``: ``[{op, module, devices, count}]``, each most frequent first.
    """

    ops: dict[str, int]  # device -> ops that ran there
    model_device: str | None  # most parameter elements off the CPU; "cpu" if all are there
    cpu_ops: list[dict[str, Any]]
    copies: list[dict[str, Any]]
    mixed: list[dict[str, Any]]
    modules: list[ModuleStats] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields above and ``total_ops`` (``modules`` stay in ``log.modules``)."""
        return {
            "ops": dict(self.ops),
            "total_ops": sum(self.ops.values()),
            "model_device": self.model_device,
            "cpu_ops": self.cpu_ops,
            "copies": self.copies,
            "mixed": self.mixed,
        }

    def __str__(self) -> str:
        from gpukit._util.text import render_table

        title = f"Placement log: {_n(sum(self.ops.values()), 'op')}"
        if self.model_device:
            title += f", model on {self.model_device}"
        rows = [[d, str(n)] for d, n in self.ops.items()]
        text = title + "\n" + render_table(None, ["device", "ops"], rows)
        if self.modules:
            rows = [
                [
                    m.name,
                    m.type,
                    str(m.calls),
                    device_counts(m.ops),
                    ", ".join(sorted(m.inputs)),
                    ", ".join(sorted(m.outputs)),
                ]
                for m in self.modules
            ]
            header = ["module", "type", "calls", "ops", "inputs on", "outputs on"]
            text += "\n" + render_table(None, header, rows)
        if self.cpu_ops:
            n = sum(c["count"] for c in self.cpu_ops)
            text += f"\n{_n(n, 'op')} ran on cpu while the model is on {self.model_device}:"
            text += _lines("{op} in {module} (x{count})", self.cpu_ops)
        if self.copies:
            n, size = sum(c["count"] for c in self.copies), sum(c["bytes"] for c in self.copies)
            text += f"\n{_n(n, 'cross-device copy', 'cross-device copies')}, {format_bytes(size)}:"
            copies = [{**c, "size": format_bytes(c["bytes"])} for c in self.copies]
            text += _lines("{op} {src}->{dst} (x{count}, {size})", copies)
        if self.mixed:
            n = sum(m["count"] for m in self.mixed)
            text += f"\n{_n(n, 'op')} mixed devices in their inputs:"
            mixed = [{**m, "devices": ", ".join(m["devices"])} for m in self.mixed]
            text += _lines("{op} in {module}: {devices} (x{count})", mixed)
        return text


def device_counts(ops: dict[str, int]) -> str:
    """Ops per device as the log writes them.

    >>> device_counts({"cuda:0": 3, "cpu": 1})
    'cpu x1, cuda:0 x3'
    """
    return ", ".join(f"{dev} x{n}" for dev, n in sorted(ops.items()))


def _lines(template: str, rows: list[dict[str, Any]], limit: int = 10) -> str:
    lines = [template.format(**row) for row in rows[:limit]]
    if len(rows) > limit:  # the text is for reading; to_dict() has them all
        lines.append(f"... and {len(rows) - limit} more")
    return "".join(f"\n  {line}" for line in lines)


def _n(n: int, noun: str, plural: str = "") -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
