"""The planner's answer: every plan, and the one to run.

>>> from gpukit.planning.result import DevicePeak, Plan
>>> from gpukit.planning.targets import target
>>> gib = 2**30
>>> small = Plan("fsdp", 2, 8, 1, "32", "off", (DevicePeak("rank 0", {"parameters": gib}),) * 2,
...              capacity_bytes=2 * gib)
>>> big = Plan("ddp", 2, 8, 1, "32", "off", (DevicePeak("rank 0", {"parameters": 3 * gib}),) * 2,
...            capacity_bytes=2 * gib)
>>> print(PlanReport("mlp", target("cpu"), (small, big)).recommendation)
fsdp on 2 devices, micro-batch 8, accumulate 1: 1 GiB peak
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.table import Table

from gpukit._util.text import format_bytes, make_table, render_plain
from gpukit.planning import registered
from gpukit.planning.result import Plan
from gpukit.planning.targets import Target


@dataclass(frozen=True)
class PlanReport:
    """Plans for one workload on one target; ``skipped`` says which cases could not be
    planned (a batch that does not split) and why."""

    workload: str
    target: Target
    plans: tuple[Plan, ...]
    skipped: tuple[str, ...] = ()
    fitted: tuple[Plan, ...] = ()  # plans that did not fit, again with a micro-batch that does

    @property
    def best(self) -> Plan | None:
        """The fastest plan that fits as asked, else the fastest of :attr:`fitted` (the same
        global batch in smaller micro-batches); None when nothing fits. On the same device
        count a simpler strategy (earlier in the registry) that fits is preferred unless the
        faster one is clearly faster (by more than ``CLEARLY_FASTER``)."""
        fitting = [p for p in self.plans if p.fits is not False]
        if not fitting:
            fitting = [p for p in self.fitted if p.fits is not False]
        if not fitting:
            return None
        fastest = max(fitting, key=_speed)
        simpler = [p for p in fitting if _simpler(p, fastest) and not _clearly(fastest, p)]
        return min(simpler, key=lambda p: _order(p.strategy)) if simpler else fastest

    def _alternative(self, best: Plan) -> str:
        """The trade-off behind :attr:`best`: the faster plan it was preferred to, or the
        simpler one that also fits and is slower, with how much; "" if none."""
        fitting = [p for p in (*self.plans, *self.fitted) if p.fits is not False]
        same = [p for p in fitting if p.devices == best.devices and p.strategy != best.strategy]
        faster = [p for p in same if _speed(p) > _speed(best)]
        if faster:
            other = max(faster, key=_speed)
            return f" ({other.strategy} would be {_gain(other, best)} faster: within "
        slower = [p for p in same if _simpler(p, best)]
        if slower:
            other = min(slower, key=lambda p: _order(p.strategy))
            return f" ({_gain(best, other)} faster than {other.strategy}, which fits too)"
        return ""

    @property
    def recommendation(self) -> str:
        """What to run, in one line: strategy, devices, micro-batch, accumulation, peak and
        step time; or why nothing fits and what would."""
        best = self.best
        if best is None:
            # The plans planned again in smaller micro-batches count too: they hold less.
            need = min((*self.plans, *self.fitted), key=lambda p: p.peak_bytes)
            steps = f", accumulate {need.accumulate}" if need.accumulate > 1 else ""
            largest = need.largest_micro_batch
            smaller = (
                "not even one sample per micro-batch fits"
                if largest == 0
                else f"micro-batch {largest} fits at that accumulation, but it does not "
                "divide the batch"
                if largest
                else "a smaller micro-batch was not searched"
            )
            return (
                f"nothing planned fits in {_bytes(self.target.memory_bytes)}: the smallest peak is "
                f"{need.strategy} on {need.devices} ({_bytes(need.peak_bytes)} at micro-batch "
                f"{need.micro_batch}{steps}; {smaller}); use more devices, fsdp, or "
                "activation checkpointing"
            )
        unit = "GPUs" if self.target.kind == "cuda" else "devices"
        text = (
            f"{best.strategy} on {best.devices} {unit if best.devices > 1 else unit[:-1]}, "
            f"micro-batch {best.micro_batch}, accumulate {best.accumulate}"
        )
        if best.activation_checkpointing != "off":
            text += f", {best.activation_checkpointing} checkpointing"
        text += f": {_bytes(best.peak_bytes)} peak"
        if best.step_time is not None:
            text += f", {best.step_time.total_s:.3g} s/step"
        alternative = self._alternative(best)
        if alternative.endswith("within "):
            alternative += f"{CLEARLY_FASTER:.0%}, the simpler one is kept)"
        return text + alternative

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"workload", "target", "plans": [...], "recommendation", "skipped"}``."""
        t = self.target
        return {
            "workload": self.workload,
            "target": {"name": t.name, "kind": t.kind, "memory_bytes": t.memory_bytes},
            "plans": [p.to_dict() for p in self.plans],
            "recommendation": self.recommendation,
            "best": self.best.to_dict() if self.best is not None else None,
            "fitted": [p.to_dict() for p in self.fitted],
            "skipped": list(self.skipped),
        }

    def table(self) -> Table:
        """One row per plan: peak of the largest device, the first device's, imbalance,
        step time split, samples/s, MFU, fits, largest micro-batch, how it was predicted."""
        header = [
            "strategy",
            "devices",
            "micro-batch",
            "peak/device",
            "1st/others",
            "s/step",
            "comm",
            "samples/s",
            "MFU",
            "fits",
            "max micro-batch",
            "method",
        ]
        rows = []
        for p in self.plans:
            st = p.step_time
            rows.append(
                [
                    p.strategy,
                    str(p.devices),
                    str(p.micro_batch),
                    _bytes(p.peak_bytes),
                    f"{p.first_over_others:.2f}",
                    "-" if st is None else f"{st.total_s:.3g}",
                    "-"
                    if st is None or not st.total_s
                    else f"{st.communication_s / st.total_s:.0%}",
                    "-" if p.samples_per_s is None else f"{p.samples_per_s:,.0f}",
                    "-" if p.mfu is None else f"{p.mfu:.0%}",
                    {True: "yes", False: "no", None: "?"}[p.fits],
                    "-" if p.largest_micro_batch is None else f"{p.largest_micro_batch:,}",
                    p.method,
                ]
            )
        title = f"Plan for {self.workload} on {self.target.name}"
        if self.target.memory_bytes:
            title += f" ({_bytes(self.target.memory_bytes)} each)"
        return make_table(title, header, rows)

    def breakdown_table(self, plan: Plan) -> Table:
        """The largest device's peak of ``plan``, by category."""
        device = max(plan.per_device, key=lambda d: d.peak_bytes)
        rows = [[k, _bytes(v)] for k, v in device.breakdown.items() if v]
        rows.append(["total", _bytes(device.peak_bytes)])
        return make_table(
            f"{plan.strategy} x{plan.devices}: {device.device} at its peak", ["part", "bytes"], rows
        )

    def __str__(self) -> str:
        parts = [render_plain(self.table(), width=160)]
        best = self.best
        if best is not None:
            parts.append(render_plain(self.breakdown_table(best)))
        notes = sorted({n for p in self.plans for n in p.notes})
        parts += [f"note: {n}" for n in [*notes, *self.skipped]]
        parts.append(f"recommendation: {self.recommendation}")
        return "\n".join(parts)


# How much faster (in samples/s) a more involved strategy must be to be recommended over a
# simpler one that fits on the same devices.
CLEARLY_FASTER = 0.10


def _order(strategy: str) -> int:
    names = registered.names()
    return names.index(strategy) if strategy in names else len(names)


def _simpler(p: Plan, than: Plan) -> bool:
    return p.devices == than.devices and _order(p.strategy) < _order(than.strategy)


def _clearly(fast: Plan, slow: Plan) -> bool:
    a, b = fast.samples_per_s, slow.samples_per_s
    return bool(a and b and a > b * (1 + CLEARLY_FASTER))


def _gain(fast: Plan, slow: Plan) -> str:
    a, b = fast.samples_per_s, slow.samples_per_s
    return f"{a / b - 1:.0%}" if a and b else "possibly"


def _speed(p: Plan) -> tuple[float, int]:
    # Fastest first; between equals (or unknown speed), fewer devices.
    return (p.samples_per_s or 0.0, -p.devices)


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)
