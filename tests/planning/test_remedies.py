"""plan_remedies: the planner's figures for an out-of-memory run and its remedies, each the same
as gk.plan gives for those settings; with_figures never hides the explanation."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit._util.text import format_bytes
from gpukit.diagnostics.oom_message import OOM_ERROR
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.planning import planner, remedies
from gpukit.planning.remedies import oom_capacity, plan_remedies, with_figures
from gpukit.planning.result import Plan
from gpukit.planning.simulate import simulate
from gpukit.planning.targets import target, with_memory

MiB = 2**20


def expected(workload: str, capacity: int | None, **settings: Any) -> Plan:
    """What gk.plan predicts for ``settings`` on the CPU with ``capacity`` bytes (None: no
    capacity, which spares the planner the largest micro-batch's second prediction)."""
    cpu = target("cpu")
    goal = with_memory(cpu, capacity) if capacity else dataclasses.replace(cpu, memory_bytes=None)
    return gk.plan(workload, target=goal, **settings).plans[0]


def test_ddp_on_two_lists_the_run_and_each_remedy_as_the_planner_predicts_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A launched rank with an injected fault: the planner must obey neither (the simulated
    # steps would fail, and its heartbeats would land in the job's folder), and both stay set.
    steering = {
        "GPUKIT_FAULT_OOM_ABOVE": "8",
        "GPUKIT_JOB_DIR": str(tmp_path),
        "RANK": "1",
        "WORLD_SIZE": "2",
    }
    for name, value in steering.items():
        monkeypatch.setenv(name, value)
    capacity = 200_000  # mlp's peaks are ~120-170 KB: everything fits
    figures = plan_remedies(
        "mlp",
        batch=64,
        devices=2,
        strategy="ddp",
        precision="32",
        capacity_bytes=capacity,
        target="cpu",
        budget_s=600,  # every figure, however loaded the machine
    )
    assert {name: os.environ.get(name) for name in steering} == steering
    assert list(tmp_path.iterdir()) == []
    for name in steering:  # gk.plan itself obeys them: the expected figures are asked without
        monkeypatch.delenv(name)
    labels = [f.label for f in figures.figures]
    assert labels == [
        "as run: ddp on 2, micro-batch 32",
        "micro-batch 16, accumulate 2",
        "bf16-mixed",
        "fsdp on 2",
        "fsdp on 2 + selective checkpointing",
    ]
    run = {"precision": "32"}
    settings: list[dict[str, object]] = [
        {**run, "strategies": ["ddp"]},
        {**run, "strategies": ["ddp"], "accumulate": 2},
        {**run, "strategies": ["ddp"], "precision": "bf16-mixed"},
        {**run, "strategies": ["fsdp"]},
        {**run, "strategies": ["fsdp"], "activation_checkpointing": "selective"},
    ]
    wanted = [
        # Only the run as it was is asked for its largest micro-batch, which needs the capacity.
        expected("mlp", capacity if i == 0 else None, batch=64, devices=2, **asked)
        for i, asked in enumerate(settings)
    ]
    for figure, want in zip(figures.figures, wanted, strict=True):
        assert figure.plan is not None, figure.reason
        got = figure.plan
        assert (got.strategy, got.micro_batch, got.accumulate, got.precision) == (
            want.strategy,
            want.micro_batch,
            want.accumulate,
            want.precision,
        )
        assert got.activation_checkpointing == want.activation_checkpointing
        assert got.peak_bytes == want.peak_bytes and got.fits is True and figure.shrunk is None
    as_run = figures.figures[0].plan
    assert as_run is not None and as_run.method == "simulation"
    assert as_run.largest_micro_batch == wanted[0].largest_micro_batch
    lines = figures.lines()
    assert lines[0] == (
        "the planner's figures for this run (per device, tensors; this device holds "
        f"{format_bytes(capacity)}):"
    )
    assert lines[1].startswith(
        f"  as run: ddp on 2, micro-batch 32: {format_bytes(as_run.peak_bytes)} peak (simulation)"
        " — fits by the planner's count"
    )
    assert (
        f"  fsdp on 2 (--strategy fsdp): {format_bytes(figures.figures[3].plan.peak_bytes)} — fits"
        in lines
    )
    assert all(len(line) <= remedies.WIDTH for line in lines)


def test_single_on_one_that_does_not_fit_shows_what_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    capacity = 15 * MiB  # gpt at micro-batch 32 peaks at ~20 MiB on the CPU, ~11 MiB at 16
    # The figures meet (the checkpointed one is asked again for its largest micro-batch, the
    # smaller micro-batch is the run planned again): each case is simulated once.
    cases: list[tuple[object, ...]] = []

    def counted(workload: object, **case: Any) -> Any:
        cases.append(tuple(sorted(case.items())))
        return simulate(workload, **case)

    monkeypatch.setattr(planner, "simulate", counted)
    figures = plan_remedies(
        "gpt",
        batch=None,
        devices=1,
        strategy="single",
        capacity_bytes=capacity,
        target="cpu",
        budget_s=600,  # every figure, however loaded the machine: the budget is tested below
    )
    assert cases and len(set(cases)) == len(cases)
    by_label = {f.label: f for f in figures.figures}
    assert list(by_label) == [
        "as run: single on 1, micro-batch 32",
        "micro-batch 16, accumulate 2",
        "bf16-mixed",
        "fsdp on 1 + selective checkpointing",
    ]  # no "fsdp on 1": one device shards nothing
    as_run = figures.figures[0].plan

    def simulated(micro: int, **settings: Any) -> int:
        # On the CPU target the planner's peak is the simulation's, nothing added.
        return simulate("gpt", devices=1, micro_batch=micro, **settings)[0].peak_bytes

    assert as_run is not None and as_run.peak_bytes == simulated(32, strategy="single")
    assert as_run.fits is False
    largest = as_run.largest_micro_batch
    assert largest is not None and 16 <= largest < 32
    assert (
        simulated(largest, strategy="single")
        <= capacity
        < simulated(largest + 1, strategy="single")
    )
    smaller = by_label["micro-batch 16, accumulate 2"].plan
    assert smaller is not None and smaller.fits
    assert smaller.peak_bytes == simulated(16, strategy="single", accumulate=2)
    checkpointed = by_label["fsdp on 1 + selective checkpointing"]
    assert checkpointed.plan is not None and checkpointed.plan.fits is False
    assert checkpointed.shrunk is not None and checkpointed.shrunk.fits is True
    assert (checkpointed.shrunk.micro_batch, checkpointed.shrunk.accumulate) == (16, 2)
    assert checkpointed.shrunk.peak_bytes == simulated(
        16, strategy="fsdp", accumulate=2, activation_checkpointing="selective"
    )
    text = str(figures)
    peak = format_bytes(as_run.peak_bytes)
    assert f"micro-batch 32: {peak} peak (simulation) — does not fit\n" in text
    assert "— does not fit; with micro-batch 16, accumulate 2: " in text


def test_many_devices_use_the_closed_form_and_the_budget_leaves_figures_out() -> None:
    many = plan_remedies(
        "mlp", batch=64, devices=16, strategy="ddp", capacity_bytes=2**30, target="cpu"
    )
    assert {f.plan.method for f in many.figures if f.plan is not None} == {"closed-form"}
    assert many.figures[0].plan is not None
    none = plan_remedies("mlp", batch=64, devices=1, strategy="single", target="cpu", budget_s=-1)
    assert none.figures[0].reason == "left out: planning took too long"
    assert "not predicted: left out" in str(none)


def test_what_the_planner_cannot_predict_says_why() -> None:
    # dp on one device is single: the planner refuses it, and the line says so.
    figures = plan_remedies("mlp", batch=64, devices=1, strategy="dp", target="cpu", budget_s=60)
    assert figures.figures[0].plan is None and "nothing to plan" in str(figures.figures[0].reason)
    assert "as run: dp on 1, micro-batch 64: not predicted: nothing to plan" in str(figures)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"devices": 0}, r"devices=0\): give a whole number of at least 1"),
        ({"accumulate": True}, r"accumulate=True"),
        ({"batch": 30, "devices": 4}, r"batch 30 does not split into 4 device\(s\).*multiple of 4"),
    ],
)
def test_settings_the_run_could_not_have_had_are_refused(
    settings: dict[str, object], match: str
) -> None:
    asked: dict[str, object] = {"batch": 64, "devices": 1, "accumulate": 1, **settings}
    with pytest.raises(ConfigError, match=match):
        plan_remedies("mlp", strategy="ddp", target="cpu", **asked)


def test_the_capacity_comes_from_the_error_that_explains_it() -> None:
    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
        "22.00 GiB of which 1.02 GiB is free."
    )
    raw = OOM_ERROR(message)
    wrapped = OutOfMemory("explained")
    wrapped.__cause__ = raw
    assert oom_capacity(raw) == oom_capacity(wrapped) == oom_capacity(message) == 22 * 2**30
    assert oom_capacity(OutOfMemory("no cause")) is None
    cpu = "DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes."
    assert oom_capacity(cpu) is None
    assert oom_capacity(None) is None


@pytest.mark.parametrize("failure", [RuntimeError("planner broke"), KeyboardInterrupt()])
def test_with_figures_gives_the_explanation_alone_when_planning_fails(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise failure

    monkeypatch.setattr(remedies, "plan", broken)
    got = with_figures(
        "out of memory on cuda:0", None, workload="mlp", batch=64, devices=1, strategy="single"
    )
    assert got == "out of memory on cuda:0"


def test_with_figures_appends_the_figures() -> None:
    err = torch.cuda.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacity of "
        "1.00 MiB of which 0 bytes is free."
    )
    got = with_figures(
        "explained", err, workload="mlp", batch=64, devices=1, strategy="single", target="cpu"
    )
    head, figures = got.split("\n", 1)
    assert head == "explained"
    assert figures.startswith(
        "the planner's figures for this run (per device, tensors; this device holds 1 MiB):\n"
        "  as run: single on 1, micro-batch 64: "
    )
