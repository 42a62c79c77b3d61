"""What each remedy for an out-of-memory error would need, in the planner's numbers.

:func:`gpukit.explain` ranks remedies by what each plausibly frees, without knowing the run.
When ``gpukit train`` runs out of memory it knows the whole run (workload, global batch,
strategy, devices, accumulation, precision), so the planner can say what each remedy would
need per device before anyone tries it. :func:`plan_remedies` predicts the run as it was and a
handful of changes that keep the global batch: a smaller micro-batch with more accumulation,
bf16 autocast (for a float32 run), fsdp over the same devices, and fsdp with activation
checkpointing; each says whether it fits the failing device, and a change that does not also
says the micro-batch that would. Each figure is one :func:`gpukit.plan` of the workload
(the closed form beyond 8 devices, where simulating gets slow), so it is the planner's to the
byte; what the planner cannot predict is listed with its reason. :func:`with_figures` appends
the figures to an explanation, and returns the explanation alone if anything goes wrong:
figures must never hide the error they explain.

>>> from gpukit.planning.result import DevicePeak, Plan
>>> gib = 2**30
>>> def planned(micro, accumulate, peak):
...     return Plan("ddp", 2, micro, accumulate, "32", "off",
...                 (DevicePeak("rank 0", {"activations": peak}),) * 2, capacity_bytes=22 * gib)
>>> print(Remedies(22 * gib, "cpu", (
...     Figure("as run: ddp on 2, micro-batch 32", "", planned(32, 1, 31 * gib)),
...     Figure("micro-batch 16, accumulate 2", "--accumulate 2", planned(16, 2, 18 * gib)),
... )))
the planner's figures for this run (per device, tensors; this device holds 22 GiB):
  as run: ddp on 2, micro-batch 32: 31 GiB peak (simulation) — does not fit
  micro-batch 16, accumulate 2 (--accumulate 2): 18 GiB — fits
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import textwrap
import time
from dataclasses import dataclass

from gpukit._util.text import format_bytes
from gpukit.diagnostics.oom_message import parse
from gpukit.errors import ConfigError, GpukitError, OutOfMemory
from gpukit.planning import registered
from gpukit.planning.planner import plan
from gpukit.planning.result import Plan
from gpukit.planning.simulated_cases import remembered
from gpukit.planning.targets import Target, with_memory
from gpukit.planning.targets import target as resolve_target
from gpukit.workloads.base import Workload, load_workload

log = logging.getLogger("gpukit")

# Beyond this many devices each figure comes from the closed form: the simulation's cost grows
# with the ranks it stands for, and a failed run should not wait long for its explanation.
SIMULATED_UP_TO = 8
# Seconds of planning after which the remaining figures are left out (a large model of one's
# own can take long to build); the explanation is what matters most.
BUDGET_S = 30.0
# Characters per line, as gpukit.explain wraps its remedies.
WIDTH = 96


@dataclass(frozen=True)
class Figure:
    """One remedy in numbers: ``label`` says what changes, ``flags`` the ``gpukit train``
    options that make the change, ``plan`` the planner's prediction; ``shrunk``: the same with
    the micro-batch cut until it fits (when ``plan`` does not fit); ``reason``: why there is no
    prediction (``plan`` is then None)."""

    label: str
    flags: str
    plan: Plan | None
    shrunk: Plan | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Remedies:
    """The planner's figures for a run that ran out of memory: ``figures[0]`` is the run as it
    was; ``capacity_bytes`` the failing device's memory (None: unknown); ``target_kind``
    "cuda" (the peaks hold the CUDA context and the allocator's reserve) or "cpu"."""

    capacity_bytes: int | None
    target_kind: str
    figures: tuple[Figure, ...]

    def lines(self) -> list[str]:
        """The figures as text: a heading, then one indented line per figure."""
        held = "tensors" if self.target_kind != "cuda" else "tensors, CUDA context and reserve"
        room = (
            "this device's capacity is unknown"
            if self.capacity_bytes is None
            else f"this device holds {format_bytes(self.capacity_bytes)}"
        )
        heading = f"the planner's figures for this run (per device, {held}; {room}):"
        lines = textwrap.wrap(heading, WIDTH, subsequent_indent="  ")
        first = self.figures[0].plan if self.figures else None
        for i, figure in enumerate(self.figures):
            text = self._line(figure, as_run=i == 0, first=first)
            lines += textwrap.wrap(
                text, WIDTH, initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False
            )
        return lines

    def _line(self, f: Figure, *, as_run: bool, first: Plan | None) -> str:
        head = f.label + (f" ({f.flags})" if f.flags else "")
        if f.plan is None:
            return f"{head}: not predicted: {f.reason}"
        text = f"{head}: {format_bytes(f.plan.peak_bytes)}"
        if as_run:
            text += f" peak ({_method(f.plan.method)})"
        elif first is None or f.plan.method != first.method:
            text += f" ({_method(f.plan.method)})"
        text += self._verdict(f.plan)
        if as_run and f.plan.fits:
            text += " by the planner's count, which leaves out other processes and cached blocks"
        if f.shrunk is not None:
            s = f.shrunk
            text += (
                f"; with micro-batch {s.micro_batch}, accumulate {s.accumulate}: "
                f"{format_bytes(s.peak_bytes)}{self._verdict(s)}"
            )
        return text

    def _verdict(self, p: Plan) -> str:
        return {True: " — fits", False: " — does not fit", None: ""}[p.fits]

    def __str__(self) -> str:
        return "\n".join(self.lines())


@dataclass(frozen=True)
class _Run:
    """The run that failed, as the planner is asked about it."""

    workload: Workload
    devices: int
    micro_batch: int
    accumulate: int
    precision: str
    activation_checkpointing: str
    target: Target
    method: str


def plan_remedies(
    workload: str | Workload,
    *,
    batch: int | None,
    devices: int,
    strategy: str,
    accumulate: int = 1,
    precision: str = "32",
    activation_checkpointing: str = "off",
    capacity_bytes: int | None = None,
    target: str | Target | None = None,
    budget_s: float = BUDGET_S,
) -> Remedies:
    """The planner's figures for a run of ``workload`` (a built-in's name, ``module:function``
    or a Workload) at global ``batch`` (None: the workload's) with ``strategy`` on ``devices``
    devices, ``accumulate`` micro-steps, ``precision`` ("32", "bf16-mixed", "16-mixed") and
    fsdp's ``activation_checkpointing``: the run as it was, then the remedies (see the module
    doc). ``capacity_bytes``: the failing device's memory (see :func:`oom_capacity`; None: the
    target's). ``target``: what :func:`gpukit.plan` takes (None: this machine). After
    ``budget_s`` seconds of planning, the figures left are listed as not predicted.

    Raises what :func:`gpukit.plan` raises for settings it refuses (a ConfigError).
    """
    for name, value in (("devices", devices), ("accumulate", accumulate), ("batch", batch)):
        whole = isinstance(value, int) and not isinstance(value, bool)
        if value is not None and not (whole and value >= 1):
            raise ConfigError(
                f"plan_remedies({name}={value!r}): give a whole number of at least 1"
                + (" (or None: the workload's batch)" if name == "batch" else "")
            )
    built = workload if isinstance(workload, Workload) else load_workload(workload, seed=0)
    goal = resolve_target(target) if not isinstance(target, Target) else target
    if capacity_bytes is not None:
        goal = with_memory(goal, capacity_bytes)
    global_batch = batch or built.batch_size
    parts = devices * accumulate
    if global_batch % parts:
        raise ConfigError(
            f"batch {global_batch} does not split into {devices} device(s) x {accumulate} "
            f"micro-step(s): give a multiple of {parts}, as the run itself needs"
        )
    micro = global_batch // parts
    run = _Run(
        built,
        devices,
        micro,
        accumulate,
        precision,
        activation_checkpointing,
        goal,
        "closed-form" if devices > SIMULATED_UP_TO else "auto",
    )
    deadline = time.monotonic() + budget_s
    with remembered():  # the figures meet: a case two of them ask for is simulated once
        figures = _figures(run, strategy, deadline)
    return Remedies(goal.memory_bytes, goal.kind, tuple(figures))


def _figures(run: _Run, strategy: str, deadline: float) -> list[Figure]:
    n, ckpt = run.devices, run.activation_checkpointing
    label = f"as run: {strategy} on {n}, micro-batch {run.micro_batch}"
    label += f", accumulate {run.accumulate}" if run.accumulate > 1 else ""
    label += f", {ckpt} checkpointing" if ckpt != "off" else ""
    as_run = _figure(run, deadline, label, "", strategy, as_run=True, shrink=False)
    figures = [as_run]
    smaller = _smaller(as_run.plan, run)
    if smaller is not None:
        micro, steps = smaller
        figures.append(
            _figure(
                run,
                deadline,
                f"micro-batch {micro}, accumulate {steps}",
                f"--accumulate {steps}",
                strategy,
                micro=micro,
                shrink=False,
            )
        )
    if run.precision == "32":
        flags = "--precision bf16-mixed"
        bf16 = _figure(run, deadline, "bf16-mixed", flags, strategy, precision="bf16-mixed")
        figures.append(bf16)
    # The strategy that shards every state, and the one with activation checkpointing, as
    # their traits say (the same one among the built-in strategies).
    shard = registered.sharding()
    if shard is not None and strategy != shard and n > 1:
        figures.append(
            _figure(
                run, deadline, f"{shard} on {n}", f"--strategy {shard}", shard, checkpointing="off"
            )
        )
    # An unknown strategy has its figure's reason already (gk.plan refused it).
    has_ckpt = strategy in registered.with_checkpointing()
    recompute = strategy if has_ckpt else next(iter(registered.with_checkpointing()), None)
    more = {"off": "selective", "selective": "full"}.get(ckpt if has_ckpt else "off")
    if more is not None and recompute is not None:
        figures.append(
            _figure(
                run,
                deadline,
                f"{recompute} on {n} + {more} checkpointing",
                f"--strategy {recompute} --activation-checkpointing {more}",
                recompute,
                checkpointing=more,
            )
        )
    return figures


def _figure(
    run: _Run,
    deadline: float,
    label: str,
    flags: str,
    strategy: str,
    *,
    micro: int | None = None,
    precision: str | None = None,
    checkpointing: str | None = None,
    shrink: bool = True,
    as_run: bool = False,
) -> Figure:
    """One remedy predicted (``as_run``: the run itself, with the largest micro-batch that
    fits); with ``shrink``, one that does not fit is predicted again at the largest micro-batch
    that fits (the same samples per device and step)."""
    if time.monotonic() > deadline:
        return Figure(label, flags, None, reason="left out: planning took too long")
    micro = micro or run.micro_batch
    ask = {
        "strategy": strategy,
        "precision": precision or run.precision,
        "checkpointing": run.activation_checkpointing if checkpointing is None else checkpointing,
    }
    try:
        predicted, fitted = _predict(run, micro=micro, largest=as_run, **ask)
    except GpukitError as err:
        return Figure(label, flags, None, reason=str(err))
    shrunk = None
    if shrink and predicted.fits is False and time.monotonic() <= deadline:
        with contextlib.suppress(GpukitError):
            if predicted.largest_micro_batch is None:  # asked again, for the largest that fits
                predicted, fitted = _predict(run, micro=micro, largest=True, **ask)
            # gk.plan planned it again at the largest micro-batch that fits; when not even
            # one sample does, the smallest micro-batch shows by how much.
            cut = _smaller(predicted, run) if fitted is None else None
            shrunk = fitted if cut is None else _predict(run, micro=cut[0], largest=False, **ask)[0]
    return Figure(label, flags, predicted, shrunk)


def _predict(
    run: _Run, *, strategy: str, micro: int, precision: str, checkpointing: str, largest: bool
) -> tuple[Plan, Plan | None]:
    """:func:`gpukit.plan` of one case; with ``largest``, also the largest micro-batch that
    fits (more predictions; without it the plan is judged against the same capacity) and,
    when the case does not fit, the case again at that micro-batch (None otherwise)."""
    steps = run.micro_batch * run.accumulate // micro
    capacity = run.target.memory_bytes
    report = plan(
        run.workload,
        batch=micro * steps * run.devices,
        devices=run.devices,
        strategies=[strategy],
        precision=precision,
        accumulate=steps,
        activation_checkpointing=checkpointing,
        target=run.target if largest else dataclasses.replace(run.target, memory_bytes=None),
        method=run.method,
    )
    fitted = report.fitted[0] if report.fitted else None
    return dataclasses.replace(report.plans[0], capacity_bytes=capacity), fitted


def _smaller(predicted: Plan | None, run: _Run) -> tuple[int, int] | None:
    """(micro-batch, accumulation) for the same samples per device and step: the largest
    micro-batch the planner says fits, or half the current one where it says the current one
    fits (or does not know); None when it is 1 already."""
    current = run.micro_batch if predicted is None else predicted.micro_batch
    per_device = run.micro_batch * run.accumulate
    largest = None if predicted is None else predicted.largest_micro_batch
    cap = current // 2 if largest is None or largest >= current else max(1, largest)
    options = [m for m in range(1, min(cap, per_device) + 1) if per_device % m == 0]
    return (max(options), per_device // max(options)) if options else None


def _method(method: str) -> str:
    return method.replace("-", " ")


def oom_capacity(err: BaseException | str | None) -> int | None:
    """The failing device's total memory, read from an out-of-memory error's message (for a
    :class:`~gpukit.errors.OutOfMemory`, its cause's), or None when the message does not say.

    >>> oom_capacity("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    ...              "capacity of 22.00 GiB of which 1.02 GiB is free.") == 22 * 2**30
    True
    """
    if err is None:
        return None
    cause = err.__cause__ if isinstance(err, OutOfMemory) else None
    numbers = parse(str(cause if cause is not None else err))
    return None if numbers is None else numbers.total


def with_figures(
    explanation: str,
    err: BaseException | str | None,
    *,
    workload: str | Workload,
    batch: int | None,
    devices: int,
    strategy: str,
    accumulate: int = 1,
    precision: str = "32",
    activation_checkpointing: str = "off",
    target: str | Target | None = None,
) -> str:
    """``explanation`` of the out-of-memory ``err`` followed by the planner's figures for the
    run (see :func:`plan_remedies`; the capacity is read from ``err``), or ``explanation``
    alone when they cannot be had, for whatever reason (an interrupt included): the figures
    never hide the error.

    >>> with_figures("out of memory", None, workload="no-such-workload", batch=8, devices=1,
    ...              strategy="single")
    'out of memory'
    """
    try:
        figures = plan_remedies(
            workload,
            batch=batch,
            devices=devices,
            strategy=strategy,
            accumulate=accumulate,
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            capacity_bytes=oom_capacity(err),
            target=target,
        )
    except (Exception, KeyboardInterrupt) as why:
        log.debug("no planner figures for the out-of-memory error: %s", why, exc_info=True)
        return explanation
    return f"{explanation}\n{figures}"
