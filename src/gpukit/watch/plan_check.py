"""The plan against what was measured: what ``gpukit plan`` predicts for the run's workload and
settings (peak memory per device, step time), beside what the run measured, with the ratio.

The run's settings come from ``metrics.json`` (the workload, global batch, strategy, devices,
accumulation, precision, activation checkpointing); the target is the GPU the run trained on
(its name, as ``metrics.json`` records it, else this machine's GPU) or the CPU. Where the run
cannot be planned (a layout of tensor or pipeline ranks, a workload this process cannot import,
a GPU the planner does not know) :class:`PlanCheck` says why instead.

>>> check = plan_check(None)
>>> check.rows, check.why
([], 'no metrics.json: the run did not finish, so its settings and measurements are not known')
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from gpukit.errors import GpukitError
from gpukit.planning.planner import plan
from gpukit.planning.result import Plan
from gpukit.planning.targets import Target, target, with_memory


@dataclass(frozen=True)
class Comparison:
    """One figure planned and measured (``None``: not known); ``unit`` "bytes" or "s".

    >>> Comparison("step time", 0.020, 0.025, "s").ratio
    1.25
    """

    what: str
    planned: float | None
    measured: float | None
    unit: str
    note: str = ""
    comparable: bool = True  # False: the two measure different things (a CPU's RSS)

    @property
    def ratio(self) -> float | None:
        """measured / planned: above 1, the run took more than planned."""
        if not self.comparable or self.planned is None or self.measured is None or not self.planned:
            return None
        return self.measured / self.planned


@dataclass
class PlanCheck:
    """The comparison rows, what was planned (in words), and ``why`` when nothing could be."""

    rows: list[Comparison] = field(default_factory=list)
    planned_for: str = ""
    why: str = ""
    notes: list[str] = field(default_factory=list)


def plan_check(
    metrics: dict[str, Any] | None,
    samples: list[dict[str, Any]] | None = None,
    method: str = "auto",
) -> PlanCheck:
    """Plan the run ``metrics`` (metrics.json) records and compare; ``samples`` (ranks.jsonl)
    give the measured step time's median where there are some. ``method`` as in
    :func:`gpukit.plan` ("closed-form": instant, what a run's own end uses)."""
    if metrics is None:
        return PlanCheck(
            why="no metrics.json: the run did not finish, so its settings and measurements "
            "are not known"
        )
    config = metrics.get("config") or {}
    runtime = config.get("runtime") or {}
    if runtime.get("parallel") is not None:
        return PlanCheck(
            why="the run trained a layout of tensor, pipeline or context ranks, which the "
            "per-strategy planner does not model: see gpukit plan --layout for its figures"
        )
    devices = max(int(metrics.get("world_size") or 1), len(metrics.get("devices") or []))
    try:
        goal = _target(metrics)
        report = plan(
            metrics["workload"],
            batch=int(metrics["global_batch"]),
            devices=devices,
            strategies=[str(metrics["strategy"])],
            precision=str(metrics["precision"]),
            accumulate=int(runtime.get("accumulate") or 1),
            activation_checkpointing=config.get("activation_checkpointing") or "off",
            target=goal,
            method=method,
            fsdp_mixed=config.get("fsdp_mixed"),
        )
    except (GpukitError, KeyError, TypeError, ValueError, ImportError) as err:
        return PlanCheck(why=f"the planner could not plan this run: {err}")
    if not report.plans:
        skipped = "; ".join(report.skipped) or "no case applies"
        return PlanCheck(why=f"the planner could not plan this run: {skipped}")
    planned = report.plans[0]
    check = PlanCheck(planned_for=_described(planned, goal), notes=list(planned.notes))
    check.rows = _rows(planned, metrics, samples or [], goal)
    return check


def _target(metrics: dict[str, Any]) -> Target:
    """The device the run trained on as a planner target: the CPU, or its GPU by the name
    metrics.json records (this machine's first GPU for a record without one), with the
    memory the run's device had."""
    devices = [str(d) for d in metrics.get("devices") or []]
    if not any(d.startswith("cuda") for d in devices):
        return target("cpu")
    goal = target(metrics.get("device_name")) if metrics.get("device_name") else target(None)
    if goal.kind != "cuda":
        raise GpukitError(
            "the run trained on a GPU whose name metrics.json does not record, and this "
            "machine has none to plan for: run gpukit report on the machine that trained it"
        )
    totals = [r.get("total") for r in (metrics.get("memory") or {}).get("devices", [])]
    known = [int(t) for t in totals if isinstance(t, (int, float)) and t > 0]
    return with_memory(goal, min(known)) if known else goal


def _described(planned: Plan, goal: Target) -> str:
    return (
        f"{planned.strategy} on {planned.devices} x {goal.name}, micro-batch "
        f"{planned.micro_batch} x {planned.accumulate}, {planned.precision} ({planned.method})"
    )


def _rows(
    planned: Plan, metrics: dict[str, Any], samples: list[dict[str, Any]], goal: Target
) -> list[Comparison]:
    rows = []
    peaks = [v for v in (metrics.get("peak_memory") or {}).values() if isinstance(v, int)]
    cpu = goal.kind == "cpu"
    rows.append(
        Comparison(
            "peak memory (largest device)",
            planned.peak_bytes,
            max(peaks) if peaks else None,
            "bytes",
            # A process's RSS holds the interpreter and its libraries beside the tensors: no
            # ratio to the planned tensors means anything there.
            "the process's resident memory (RSS) on a CPU: the interpreter and libraries "
            "too, so no ratio; the tensors' row compares"
            if cpu
            else "the caching allocator's peak; the plan adds the CUDA context and the "
            "allocator's reserve, which it does not count",
            comparable=not cpu,
        )
    )
    tensors = [
        r.get("peak_tensors")
        for r in (metrics.get("memory") or {}).get("devices", [])
        if isinstance(r.get("peak_tensors"), int)
    ]
    rows.append(
        Comparison(
            "peak of tensors (largest device)",
            max(d.tensor_bytes for d in planned.per_device),
            max(tensors) if tensors else None,
            "bytes",
            "tensors alone, over the run's first steps",
        )
    )
    step, note = _measured_step(metrics, samples)
    planned_s = planned.step_time.total_s if planned.step_time is not None else None
    rows.append(Comparison("step time", planned_s, step, "s", note))
    return rows


def _measured_step(
    metrics: dict[str, Any], samples: list[dict[str, Any]]
) -> tuple[float | None, str]:
    """The run's seconds per optimizer step: the median of the ranks' own medians in
    ranks.jsonl's samples where there are some, else metrics.json's global batch over its
    samples/s (this session's steps, validation left out)."""
    medians = [
        float(r["step_s_median"])
        for s in samples
        for r in s.get("ranks", [])
        if isinstance(r.get("step_s_median"), (int, float)) and r["step_s_median"] > 0
    ]
    if medians:
        return statistics.median(medians), "median over the ranks' samples (ranks.jsonl)"
    rate, batch = metrics.get("samples_per_s"), metrics.get("global_batch")
    if isinstance(rate, (int, float)) and rate > 0 and isinstance(batch, int):
        return batch / rate, "global batch / samples per second (metrics.json)"
    return None, "not measured"
