"""``gk.plan``: strategies per device count (:func:`gpukit.planning.planner.plan`), or, when a
``layout`` is asked, layouts of data, tensor, pipeline and context parallelism
(:func:`gpukit.planning.layout_search.plan_layout`): one entry, as ``gpukit plan`` is one
command.

>>> from gpukit.planning.layout_shape import TransformerShape
>>> s = TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192)
>>> plan(s, devices=8, batch=8, target="h100", layout={"tp": 2, "dp_shard": 4}).best.fits
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, overload

from gpukit.errors import ConfigError
from gpukit.planning import planner
from gpukit.planning.calibrate import Calibration
from gpukit.planning.layout_search import LayoutReport, plan_layout
from gpukit.planning.layouts import Layout
from gpukit.planning.report import PlanReport
from gpukit.planning.targets import Target
from gpukit.workloads.base import Workload

WorkloadLike = str | Workload | Callable[[], Workload]


@overload
def plan(
    workload: WorkloadLike,
    *,
    batch: int | None = None,
    devices: int | Sequence[int] = 1,
    strategies: Sequence[str] | None = None,
    precision: str = "auto",
    accumulate: int = 1,
    activation_checkpointing: str | None = None,
    optimizer: str = "adamw",
    target: str | Target | None = None,
    memory: int | None = None,
    method: str = "auto",
    calibration: Calibration | None = None,
    fsdp_mixed: str | None = None,
    layout: None = None,
) -> PlanReport: ...


@overload
def plan(
    workload: Any,
    *,
    batch: int | None = None,
    devices: int | Sequence[int] = 1,
    activation_checkpointing: str | None = None,
    target: str | Target | None = None,
    memory: int | None = None,
    layout: str | Layout | dict[str, Any],
    float8: str | None = None,
    async_tp: bool = False,
) -> LayoutReport: ...


def plan(
    workload: Any,
    *,
    batch: int | None = None,
    devices: int | Sequence[int] = 1,
    strategies: Sequence[str] | None = None,
    precision: str = "auto",
    accumulate: int = 1,
    activation_checkpointing: str | None = None,
    optimizer: str = "adamw",
    target: str | Target | None = None,
    memory: int | None = None,
    method: str = "auto",
    calibration: Calibration | None = None,
    fsdp_mixed: str | None = None,
    layout: str | Layout | dict[str, Any] | None = None,
    float8: str | None = None,
    async_tp: bool = False,
) -> PlanReport | LayoutReport:
    """Without ``layout``: :func:`gpukit.planning.planner.plan`'s plans of each strategy on
    each device count (``activation_checkpointing`` None: "off"). With ``layout`` ("auto",
    a :class:`~gpukit.planning.layouts.Layout` or a dict of its sizes): the layouts of
    ``devices`` GPUs (one count) planned by :func:`gpukit.planning.layout_search.plan_layout`
    for a Llama-style ``workload``, with ``float8`` and ``async_tp`` (checkpointing None:
    "full"; ``target`` None: an H100). The strategies' own settings do not apply to layouts
    and are refused with one."""
    if layout is None:
        if float8 is not None or async_tp:
            raise ConfigError(
                "float8 and async_tp are settings of layouts: give layout='auto' (or the sizes) "
                "with them"
            )
        return planner.plan(
            workload,
            batch=batch,
            devices=devices,
            strategies=strategies,
            precision=precision,
            accumulate=accumulate,
            activation_checkpointing=activation_checkpointing or "off",
            optimizer=optimizer,
            target=target,
            memory=memory,
            method=method,
            calibration=calibration,
            fsdp_mixed=fsdp_mixed,
        )
    given = {
        "strategies": strategies is not None,
        "precision": precision != "auto",
        "accumulate": accumulate != 1,
        "optimizer": optimizer != "adamw",
        "method": method != "auto",
        "calibration": calibration is not None,
        "fsdp_mixed": fsdp_mixed is not None,
    }
    strays = [name for name, set_ in given.items() if set_]
    if strays:
        raise ConfigError(
            f"{', '.join(strays)} with layout={layout!r}: those plan strategies; a layout is "
            "planned with bf16 FSDP2 and AdamW, as torchtitan runs it. Leave them out, or "
            "leave layout out"
        )
    counts = [devices] if isinstance(devices, int) else list(devices)
    if len(counts) != 1:
        raise ConfigError(
            f"devices={devices!r} with layout={layout!r}: give one GPU count (e.g. devices=64)"
        )
    return plan_layout(
        workload,
        devices=counts[0],
        layout=layout,
        batch=batch,
        target=target if target is not None else "h100",
        memory=memory,
        activation_checkpointing=activation_checkpointing or "full",
        float8=float8,
        async_tp=async_tp,
    )


__all__ = ["plan"]
