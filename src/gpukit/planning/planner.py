"""``gk.plan``: predict every (strategy, device count) for a workload before running it.

For each case the simulation (:mod:`gpukit.planning.simulate`: gpukit's own code over fake
tensors, one rank standing for N) gives each device's peak tensor memory; where it cannot run
(one process driving every device, as dp does; a model whose forward needs values) the closed form
(:mod:`gpukit.planning.closed_form`) does, and the plan says why in its notes. On a GPU target
the CUDA context and the caching allocator's reserve are added (measured when the plan is
calibrated on the GPU itself, else the target's documented defaults). The step time comes
from :mod:`gpukit.planning.timing`. The largest micro-batch that fits is searched with further
predictions (see :mod:`gpukit.planning.search`); a case one call asks for twice is simulated
once (:mod:`gpukit.planning.simulated_cases`). The recommendation is the fastest plan that fits;
a plan that does not fit is planned again with the same global batch in smaller micro-batches
and more accumulation.

>>> report = plan("mlp", devices=[1, 2], strategies=["single", "ddp", "fsdp"], target="cpu")
>>> [(p.strategy, p.devices) for p in report.plans]
[('single', 1), ('ddp', 1), ('ddp', 2), ('fsdp', 1), ('fsdp', 2)]
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from gpukit.errors import ConfigError, GpukitError
from gpukit.planning import arguments, registered
from gpukit.planning.arguments import CHECKPOINTING
from gpukit.planning.calibrate import Calibration
from gpukit.planning.closed_form import closed_form, model_facts
from gpukit.planning.facts import ModelFacts
from gpukit.planning.report import PlanReport
from gpukit.planning.result import DevicePeak, Plan
from gpukit.planning.search import largest_micro_batch
from gpukit.planning.simulate import SimulationUnsupported, simulate
from gpukit.planning.simulated_cases import remembering, simulated
from gpukit.planning.targets import Target
from gpukit.planning.timing import step_time
from gpukit.planning.timing_notes import step_time_notes
from gpukit.workloads.base import Workload


@dataclass(frozen=True)
class _Setting:
    batch: int  # global; 0: the workload's
    accumulate: int
    precision: str
    activation_checkpointing: str
    optimizer: str
    target: Target
    method: str
    calibration: Calibration | None
    fsdp_mixed: str | None = None


@dataclass(frozen=True)
class _Subject:
    """What every plan of one call shares: the workload as given (the simulation builds its
    own from a name) and as built, its closed-form facts (None, with the reason, when the
    closed form cannot model it) and the settings."""

    source: Any
    built: Workload
    facts: ModelFacts | None
    facts_note: str | None
    setting: _Setting
    mixed_facts: ModelFacts | None = None  # measured with bf16 parameters (fsdp_mixed)


@remembering  # a case the call asks for twice is simulated once
def plan(
    workload: str | Workload | Callable[[], Workload],
    *,
    batch: int | None = None,
    devices: int | Sequence[int] = 1,
    strategies: Sequence[str] | None = None,
    precision: str = "auto",
    accumulate: int = 1,
    activation_checkpointing: str = "off",
    optimizer: str = "adamw",
    target: str | Target | None = None,
    memory: int | None = None,
    method: str = "auto",
    calibration: Calibration | None = None,
    fsdp_mixed: str | None = None,
) -> PlanReport:
    """Plans for ``workload`` (a built-in's name, ``module:function``, a Workload or a function
    returning one) at global ``batch`` (default: the workload's) on each count in ``devices``
    with each of ``strategies`` (default: single on 1, ddp and fsdp on every count, dp and
    dp-balanced on more than 1); see the module doc. ``target``: a GPU name ("h100"), "cpu",
    or None for this machine; ``memory`` overrides its bytes. ``method``: "auto" (simulate
    where possible) or "closed-form" (instant). ``calibration``: measured on the target by
    :func:`gpukit.planning.calibrate.calibrate`. ``fsdp_mixed``: "bf16" plans the strategies
    that gather weights (fsdp) with FSDP2's mixed precision, as ``FSDP(mixed="bf16")`` runs:
    bf16 parameters and compute, float32 gradient reduction (closed form). A model on the meta
    device is planned by the closed form without materialising it."""
    built = arguments.workload(workload)
    counts = arguments.counts(devices)
    arguments.choice("activation_checkpointing", activation_checkpointing, CHECKPOINTING)
    chosen = arguments.strategies(strategies, counts, activation_checkpointing)
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ConfigError(
            f"calibration={type(calibration).__name__}: give what "
            "gpukit.planning.calibrate.calibrate(...) returns, or None"
        )
    goal = arguments.target(target, memory)
    setting = _Setting(
        batch=arguments.positive("batch", batch) if batch is not None else 0,
        accumulate=arguments.positive("accumulate", accumulate),
        precision=arguments.precision(precision, goal),
        activation_checkpointing=arguments.choice(
            "activation_checkpointing", activation_checkpointing, CHECKPOINTING
        ),
        optimizer=optimizer,
        target=goal,
        method=arguments.choice("method", method, ("auto", "closed-form")),
        calibration=calibration,
        fsdp_mixed=arguments.mixed(fsdp_mixed, chosen),
    )
    facts, facts_note = _facts(built, setting)
    mixed_facts = _facts(built, setting, torch.bfloat16)[0] if setting.fsdp_mixed else None
    subject = _Subject(workload, built, facts, facts_note, setting, mixed_facts)
    plans: list[Plan] = []
    skipped: list[str] = []
    for strategy in chosen:
        for n in counts:
            if not registered.traits(strategy).runs_on(n):
                continue  # a count its traits do not plan it on (one device: plain training)
            # No batch given: the workload's, split as far as it goes (one sample per device
            # at least, so any count can be planned).
            asked = setting.batch or max(built.batch_size, n * setting.accumulate)
            micro, left = divmod(asked, n * setting.accumulate)
            if not setting.batch and left:
                micro, left = max(1, micro), 0
            if micro < 1 or left:
                skipped.append(
                    f"{strategy} on {n}: batch {setting.batch} does not split into {n} device(s) "
                    f"x {setting.accumulate} micro-step(s)"
                )
                continue
            plans.append(_plan(subject, strategy, n, micro))
    if not plans:
        raise ConfigError("nothing to plan: " + "; ".join(skipped) + ". Give a batch that divides")
    fitted = [f for f in (_fitted(subject, p) for p in plans) if f is not None]
    return PlanReport(built.name, goal, tuple(plans), tuple(skipped), tuple(fitted))


# Times a plan that does not fit is planned again with a smaller micro-batch.
FIT_ROUNDS = 3


def _fitted(subject: _Subject, p: Plan) -> Plan | None:
    """For a plan that does not fit: the same global batch with the largest micro-batch
    that fits (and divides this device's samples per step) and more accumulation, planned
    again; None when it fits already or not even one sample fits. Accumulating can itself
    hold more (gradients kept between micro-steps, the whole step's batch loaded at once),
    so a plan planned again that still does not fit is cut again by its own largest
    micro-batch, up to ``FIT_ROUNDS`` times; the last is returned, fitting or not."""
    if p.fits is not False or not p.largest_micro_batch:
        return None
    per_device = p.micro_batch * p.accumulate
    again: Plan | None = None
    largest = p.largest_micro_batch
    for _ in range(FIT_ROUNDS):
        micro = max(m for m in range(1, min(largest, per_device) + 1) if not per_device % m)
        if again is not None and micro >= again.micro_batch:
            break
        setting = replace(subject.setting, accumulate=per_device // micro)
        try:
            again = _plan(replace(subject, setting=setting), p.strategy, p.devices, micro, largest)
        except GpukitError:
            break
        if again.fits is not False or not again.largest_micro_batch:
            break
        largest = again.largest_micro_batch
    return again


def _plan(subject: _Subject, strategy: str, n: int, micro: int, hint: int | None = None) -> Plan:
    """One case planned; ``hint``: a guess at its largest micro-batch (see
    :func:`gpukit.planning.search.largest_micro_batch`)."""
    s = subject.setting
    notes = [subject.facts_note] if subject.facts_note else []
    peaks, method = _peaks(subject, strategy, n, micro, notes)
    per_device = tuple(_with_overheads(p, s, i, strategy) for i, p in enumerate(peaks))
    base = Plan(
        strategy=strategy,
        devices=n,
        micro_batch=micro,
        accumulate=s.accumulate,
        precision=s.precision,
        activation_checkpointing=s.activation_checkpointing,
        per_device=per_device,
        capacity_bytes=s.target.memory_bytes,
        method=method,  # type: ignore[arg-type]
    )
    peak = functools.partial(_peak, subject, strategy, n)
    largest = largest_micro_batch(peak, s.target.memory_bytes, micro, base.peak_bytes, notes, hint)
    timed = _timed(base, subject)
    return replace(timed, largest_micro_batch=largest, notes=(*notes, *timed.notes))


def _peaks(
    subject: _Subject, strategy: str, n: int, micro: int, notes: list[str]
) -> tuple[tuple[DevicePeak, ...], str]:
    s, facts = subject.setting, subject.facts
    mixed = s.fsdp_mixed if registered.traits(strategy).gathers_weights else None
    if mixed is not None:
        facts = subject.mixed_facts
        notes.append(f"{strategy}: mixed precision {mixed} (float32 reduction), closed form")
    elif s.method == "auto":
        try:
            return _simulated(subject, strategy, n, micro), "simulation"
        except SimulationUnsupported as why:
            notes.append(f"{strategy}: closed form, since {why}")
    if facts is None:
        raise ConfigError(
            f"{subject.built.name}: neither the simulation nor the closed form can model it "
            f"({'; '.join(notes)})"
        )
    return (
        closed_form(
            facts,
            strategy=strategy,
            devices=n,
            micro_batch=micro,
            accumulate=s.accumulate,
            optimizer=s.optimizer,
            precision=s.precision,
            granularity=_granularity(s.target),
            mixed=mixed,
        ),
        "closed-form",
    )


def _simulated(subject: _Subject, strategy: str, n: int, micro: int) -> tuple[DevicePeak, ...]:
    s, source = subject.setting, subject.source
    if any(p.is_meta for p in subject.built.model.parameters()):
        raise SimulationUnsupported(
            "the model is on the meta device (shapes only): the closed form plans it "
            "without materialising it"
        )
    if s.optimizer != "adamw":
        raise SimulationUnsupported(
            f"the simulation trains with AdamW, as gpukit train does; {s.optimizer} is modelled "
            "by the closed form"
        )
    what = source if isinstance(source, str) else subject.built
    precision, granularity = _local_precision(s.precision), _granularity(s.target)
    case = (strategy, n, micro, s.accumulate, precision, s.activation_checkpointing, granularity)
    return simulated(
        what,
        case,
        lambda: simulate(
            what,
            strategy=strategy,
            devices=n,
            micro_batch=micro,
            accumulate=s.accumulate,
            precision=precision,
            activation_checkpointing=s.activation_checkpointing,
            granularity=granularity,
        ),
    )


def _peak(subject: _Subject, strategy: str, n: int, micro: int) -> int:
    """The largest of the devices' predicted peaks at ``micro``, overheads included."""
    s = subject.setting
    peaks, _ = _peaks(subject, strategy, n, micro, [])
    return max(_with_overheads(p, s, i, strategy).peak_bytes for i, p in enumerate(peaks))


def _timed(base: Plan, subject: _Subject) -> Plan:
    s, facts, built = subject.setting, subject.facts, subject.built
    flops = built.flops_per_sample or (facts.flops_per_sample if facts else 0.0)
    if facts is None:
        return base
    try:
        time, per_s, mfu = step_time(
            target=s.target,
            strategy=base.strategy,
            devices=base.devices,
            micro_batch=base.micro_batch,
            accumulate=base.accumulate,
            flops_per_sample=flops,
            trainable_bytes=facts.trainable_bytes,
            largest_group_bytes=facts.largest_group_bytes,
            precision=s.precision,
            calibration=s.calibration,
            io_bytes_per_sample=facts.input_bytes_per_sample + facts.output_bytes_per_sample,
            mixed=s.fsdp_mixed if registered.traits(base.strategy).gathers_weights else None,
            trainable_numel=facts.trainable_numel,
        )
    except GpukitError as err:
        return replace(base, notes=(*base.notes, f"step time unknown: {err}"))
    notes = (*base.notes, *step_time_notes(s.calibration, base.strategy, base.devices))
    return replace(base, step_time=time, samples_per_s=per_s, mfu=mfu, notes=notes)


def _with_overheads(peak: DevicePeak, s: _Setting, index: int, strategy: str) -> DevicePeak:
    """On a GPU: the CUDA context and the allocator's reserve above the tensors, on the
    device ``cuda:index``. The reserve is a share of the tensors (blocks split and cached)
    and, for a strategy that gathers weights, its communication buffers once more: fsdp
    allocates them on its all-gather and reduce-scatter streams, and the caching allocator
    reuses a freed block only on the stream that allocated it, so what those streams cached
    stays reserved beside the compute stream's own (not when calibrated: measured)."""
    if s.target.kind != "cuda":
        return peak
    reserve = s.target.allocator_reserve_fraction
    context = s.target.cuda_context_bytes
    streams = 0
    if s.calibration is not None:
        reserve, context = s.calibration.reserve_fraction, s.calibration.context_bytes
    elif registered.traits(strategy).gathers_weights:
        streams = peak.breakdown.get("communication", 0)
    held = int(peak.tensor_bytes * reserve) + streams
    extra = {"cuda_context": context, "allocator_reserve": held}
    return DevicePeak(f"cuda:{index}", {**peak.breakdown, **extra})


def _facts(
    built: Workload, s: _Setting, param_dtype: torch.dtype | None = None
) -> tuple[ModelFacts | None, str | None]:
    try:
        example = built.dataset[0]
        with contextlib.redirect_stdout(io.StringIO()):
            return (
                model_facts(
                    built.model,
                    example,
                    precision=_local_precision(s.precision),
                    activation_checkpointing=s.activation_checkpointing,
                    flops_per_sample=built.flops_per_sample,
                    loss=built.loss,
                    param_dtype=param_dtype,
                ),
                None,
            )
    except GpukitError as err:
        return None, f"no closed form: {err}"


def _local_precision(precision: str) -> str:
    # The simulation runs on this CPU: 16-mixed's scaler is the GPU's business; its tensors
    # are those of bf16 autocast (two bytes each).
    return "bf16-mixed" if precision == "16-mixed" else precision


def _granularity(goal: Target) -> int:
    return 512 if goal.kind == "cuda" else 1
