"""Plans of layouts: one layout given, or every valid layout of a GPU count searched for the
fastest that fits, with one line saying why (``gk.plan_layout``, ``gpukit plan --layout auto``,
:func:`choose_layout` for ``parallel="auto"``).

Each layout is planned in closed form (:mod:`gpukit.planning.layout_memory`,
:mod:`gpukit.planning.layout_time`), so hundreds of them take well under a second.

>>> from gpukit.planning.layout_shape import TransformerShape
>>> s = TransformerShape(8192, 80, 64, 8, 28672, 128256, 8192)
>>> degrees, why = choose_layout(s, 64, "h100", batch=64)
>>> degrees["tp"] * degrees["pp"] * degrees["dp_shard"] * degrees["cp"] * degrees["dp_replicate"]
64
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from gpukit._util.text import format_bytes
from gpukit.errors import ConfigError
from gpukit.planning import arguments
from gpukit.planning.layout_memory import CHECKPOINTING, layout_memory
from gpukit.planning.layout_shape import TransformerShape, shape_of
from gpukit.planning.layout_time import LayoutTime, float8_speedup, layout_time
from gpukit.planning.layouts import GPUS_PER_NODE, Layout, candidates, check
from gpukit.planning.targets import Target

# Layouts whose planned speeds differ by less than this are as fast as the plan can tell.
AS_FAST = 0.01
# Layouts a report prints (of hundreds searched): the fastest that fit first.
SHOWN = 10


@dataclass(frozen=True)
class LayoutPlan:
    """One layout planned: the largest GPU's memory by category (``breakdown``, bytes), the
    step time by cause, and whether it fits ``capacity_bytes``."""

    layout: Layout
    local_batch: int
    breakdown: dict[str, int]
    time: LayoutTime
    capacity_bytes: int | None

    @property
    def peak_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def fits(self) -> bool | None:
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "layout": {
                **self.layout.degrees,
                "pp_schedule": self.layout.pp_schedule,
                "microbatches": self.layout.microbatches,
                "float8": self.layout.float8,
                "async_tp": self.layout.async_tp,
            },
            "local_batch": self.local_batch,
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "fits": self.fits,
            "step_time": self.time.to_dict(),
            "tokens_per_s_per_gpu": self.time.tokens_per_s_per_gpu,
        }


@dataclass(frozen=True)
class LayoutReport:
    """Every layout planned for one model on ``gpus`` GPUs of ``target``; ``best``: the
    fastest that fits (None when none does), ``reason`` the one line why."""

    model: TransformerShape
    gpus: int
    target: Target
    plans: tuple[LayoutPlan, ...]
    activation_checkpointing: str = "full"

    @property
    def fitting(self) -> list[LayoutPlan]:
        return [p for p in self.plans if p.fits is not False]

    @property
    def best(self) -> LayoutPlan | None:
        """The fastest layout that fits; of those within :data:`AS_FAST` of it, the one that
        holds the least (the headroom is worth more than a speed the plan cannot tell)."""
        fitting = self.fitting
        if not fitting:
            return None
        fastest = _speed(max(fitting, key=_speed))
        close = [p for p in fitting if _speed(p) >= fastest * (1 - AS_FAST)]
        return min(close, key=lambda p: (p.peak_bytes, -_speed(p)))

    @property
    def reason(self) -> str:
        """Why :attr:`best`, in one line (or why nothing fits, and what holds the least)."""
        cap = self.target.memory_bytes
        best = self.best
        if best is None:
            least = min(self.plans, key=lambda p: p.peak_bytes)
            full = self.activation_checkpointing == "full"
            return (
                f"nothing of {len(self.plans)} layout(s) fits {format_bytes(cap or 0)}: the "
                f"smallest, {least.layout.describe()}, needs {format_bytes(least.peak_bytes)} per "
                f"GPU; use more GPUs{' or' if full else ','} a smaller batch"
                + ("" if full else " or full checkpointing")
            )
        line = f"{best.layout.describe()}: fits in {format_bytes(best.peak_bytes)}"
        line += f" of {format_bytes(cap)}" if cap else ""
        line += f", {best.time.tokens_per_s_per_gpu:,.0f} tokens/s per GPU"
        if len(self.plans) == 1:
            return line
        line += f"; fastest of {len(self.fitting)} that fit"
        if _speed(best) < max(_speed(p) for p in self.fitting):
            line += f" (within {AS_FAST:.0%}, holding the least)"
        runner = _runner_up(self.fitting, best)
        if runner is None:
            return line
        slower = 1 - _speed(runner) / _speed(best)
        if slower < AS_FAST:
            return (
                f"{line}; {runner.layout.describe()} is as fast (within {AS_FAST:.0%}), "
                f"needing {format_bytes(runner.peak_bytes)}"
            )
        cause = _main_cost(runner.time)
        return (
            f"{line}; {runner.layout.describe()} would fit too but is {slower:.0%} slower ({cause})"
        )

    def to_dict(self) -> dict[str, Any]:
        """What ``gpukit plan --layout ... --json`` prints."""
        best = self.best
        return {
            "gpus": self.gpus,
            "target": self.target.name,
            "best": best.to_dict() if best else None,
            "reason": self.reason,
            "plans": [p.to_dict() for p in self.plans],
        }

    def __str__(self) -> str:
        shown = sorted(self.plans, key=lambda p: (p.fits is False, -_speed(p)))[:SHOWN]
        more = len(self.plans) > SHOWN
        lines = [
            f"{len(self.plans)} layout(s) of {self.gpus} {self.target.name} GPUs"
            + (f" ({SHOWN} shown, the fastest that fit first; --json lists all):" if more else ":")
        ]
        for p in shown:
            mark = "fits" if p.fits is not False else "over"
            lines.append(
                f"  {p.layout.describe():48s} {format_bytes(p.peak_bytes):>10s} {mark}  "
                f"{p.time.tokens_per_s_per_gpu:>9,.0f} tokens/s/GPU"
            )
        lines.append(f"plan: {self.reason}")
        return "\n".join(lines)


def plan_layout(
    model: Any,
    *,
    devices: int,
    layout: Layout | dict[str, Any] | str = "auto",
    batch: int | None = None,
    seq_len: int | None = None,
    target: str | Target | None = "h100",
    memory: int | None = None,
    activation_checkpointing: str = "full",
    float8: str | None = None,
    async_tp: bool = False,
    gpus_per_node: int = GPUS_PER_NODE,
) -> LayoutReport:
    """Plans of ``model`` (a gpukit Llama workload, its name, a function returning one, its
    model, or a :class:`~gpukit.planning.layout_shape.TransformerShape`) on ``devices`` GPUs:
    the one
    ``layout`` (a :class:`~gpukit.planning.layouts.Layout` or a dict of its fields), or with
    ``"auto"`` every valid layout (see :func:`gpukit.planning.layouts.candidates`) with
    ``float8`` and ``async_tp`` as given (a layout given says its own: another beside it is
    refused). ``batch``: global, in samples of ``seq_len`` tokens
    (default: one per data-parallel rank). ``target`` and ``memory`` as in ``gk.plan``.

    >>> report = plan_layout("gpukit.workloads.llama:llama3_70b", devices=256, batch=512)
    >>> report.best is not None and report.best.fits
    True
    """
    named = isinstance(model, str) or (callable(model) and not isinstance(model, nn.Module))
    shape = shape_of(arguments.workload(model) if named else model, seq_len)
    gpus = arguments.positive("devices", devices)
    goal = arguments.target(target, memory)
    arguments.choice("activation_checkpointing", activation_checkpointing, CHECKPOINTING)
    asked = layout.float8 if isinstance(layout, Layout) else float8
    if isinstance(layout, dict):
        asked = layout.get("float8", float8)
    if asked is not None and float8_speedup(goal, "tensorwise") == 1.0:
        raise ConfigError(
            f"float8={asked!r} on {goal.name}: it has no float8 tensor cores (torchao's float8 "
            "needs compute capability 8.9 or 9.0: H100, H200, L40S, L4); plan it without float8"
        )
    if batch is not None:
        arguments.positive("batch", batch)
    if isinstance(layout, str):
        if layout != "auto":
            raise ConfigError(f"layout={layout!r}: give 'auto', a Layout, or a dict of its sizes")
        found = candidates(
            shape,
            gpus,
            local_batch_of=batch,
            float8=float8,
            async_tp=async_tp,
            gpus_per_node=gpus_per_node,
        )
        if not found:
            raise ConfigError(
                f"no layout of {gpus} GPUs splits this model (heads {shape.heads}, key/value heads "
                f"{shape.kv_heads}, {shape.layers} blocks, {shape.seq_len} tokens) and a batch of "
                f"{batch}: give a GPU count and batch that divide"
            )
    else:
        found = [_given(layout, float8, async_tp)]
    plans = []
    for chosen in found:
        data = chosen.data_parallel
        total = batch if batch is not None else data
        if total % data:
            raise ConfigError(
                f"batch={total} does not split over {data} data-parallel ranks "
                f"(dp_replicate x dp_shard): give a multiple of {data}"
            )
        local = total // data
        check(chosen, shape, gpus, local_batch=local, gpus_per_node=gpus_per_node)
        parts = layout_memory(
            shape, chosen, local_batch=local, checkpointing=activation_checkpointing
        )
        time = layout_time(
            shape,
            chosen,
            goal,
            local_batch=local,
            checkpointing=activation_checkpointing,
            gpus_per_node=gpus_per_node,
        )
        plans.append(LayoutPlan(chosen, local, parts, time, goal.memory_bytes))
    return LayoutReport(shape, gpus, goal, tuple(plans), activation_checkpointing)


def choose_layout(
    model: Any,
    world_size: int,
    device_kind: str | Target | None,
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    activation_checkpointing: str = "full",
    float8: str | None = None,
) -> tuple[dict[str, int], str]:
    """The layout a run of ``model`` on ``world_size`` GPUs of ``device_kind`` (a name such as
    "h100" or torch's ``get_device_name()``, a Target, or None, "cuda" or "gpu" for this
    machine's first GPU) should use: ``({"dp_replicate": ..., "dp_shard": ..., "tp": ...,
    "pp": ..., "cp": ...}, reason)``, the fastest that fits, with the one line why. ``model``:
    what :func:`plan_layout` takes (a model on the meta device will do); ``batch``: the global
    batch in samples (None: one per data-parallel rank, which leaves pipelines out). When
    nothing fits, a :class:`~gpukit.errors.ConfigError` says what holds the least;
    ``parallel="auto"`` calls this once, before building the mesh.

    >>> llama_8b = TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192)
    >>> degrees, why = choose_layout(llama_8b, 8, "NVIDIA H100 80GB HBM3", batch=8)
    >>> degrees
    {'dp_replicate': 1, 'dp_shard': 8, 'tp': 1, 'pp': 1, 'cp': 1}
    >>> why.split(";")[0]
    'dp_shard 8: fits in 41.7 GiB of 79.6 GiB, 5,554 tokens/s per GPU'
    """
    if isinstance(device_kind, str) and device_kind.strip().lower() in ("cuda", "gpu"):
        device_kind = None  # the kind a device names, not a model: this machine's GPU
    report = plan_layout(
        model,
        devices=world_size,
        batch=batch,
        seq_len=seq_len,
        target=device_kind,
        activation_checkpointing=activation_checkpointing,
        float8=float8,
    )
    best = report.best
    if best is None:
        raise ConfigError(f"parallel='auto': {report.reason}")
    return best.layout.degrees, report.reason


def _given(layout: Layout | dict[str, Any], float8: str | None, async_tp: bool) -> Layout:
    if isinstance(layout, (Layout, dict)):
        # The layout's own float8 and async_tp would win: refuse another given beside it.
        own = vars(layout) if isinstance(layout, Layout) else layout
        for name, value, unset in (("float8", float8, None), ("async_tp", async_tp, False)):
            if value != unset and name in own and own[name] != value:
                raise ConfigError(
                    f"{name}={value!r} and a layout whose {name} is {own[name]!r}: give it "
                    "once, in the layout or beside it"
                )
    if isinstance(layout, Layout):
        return layout
    if not isinstance(layout, dict):
        raise ConfigError(
            f"layout={type(layout).__name__}: give 'auto', a gpukit Layout, or a dict such as "
            "{'tp': 8, 'dp_shard': 4}"
        )
    fields = set(Layout.__dataclass_fields__)
    unknown = sorted(set(layout) - fields)
    if unknown:
        raise ConfigError(
            f"layout has no {', '.join(unknown)}: its fields are {', '.join(sorted(fields))}"
        )
    return replace(Layout(float8=float8, async_tp=async_tp), **layout)


def _speed(p: LayoutPlan) -> float:
    return p.time.tokens_per_s_per_gpu


def _runner_up(fitting: list[LayoutPlan], best: LayoutPlan) -> LayoutPlan | None:
    """The fastest fitting layout that differs from ``best`` in its sizes (not only its
    schedule), to say what the choice wins over."""
    others = [p for p in fitting if p.layout.degrees != best.layout.degrees]
    return max(others, key=_speed) if others else None


def _main_cost(t: LayoutTime) -> str:
    """The largest cost beside compute, in words."""
    costs = {
        "its pipeline bubble": t.pipeline_bubble_s,
        "tensor parallelism's collectives": t.tensor_parallel_s,
        "context parallelism's ring": t.context_parallel_s,
        "FSDP's collectives": t.data_parallel_s,
        "pipeline sends": t.pipeline_send_s,
    }
    name, seconds = max(costs.items(), key=lambda kv: kv[1])
    if seconds <= 0.0:
        return "less compute per GPU overlapped"
    return f"{name}: {seconds / t.total_s:.0%} of its step"


__all__ = ["LayoutPlan", "LayoutReport", "choose_layout", "plan_layout"]
