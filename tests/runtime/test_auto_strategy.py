"""``strategy="auto"`` over several devices: ddp, unless the planner's closed form says ddp
cannot fit a device and fsdp can, decided once at the first ``rt.setup`` (device memory is
mocked: each device's ``total_memory`` is set in the ranks before setup)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
import gpukit.planning.auto as auto
from gpukit.planning.closed_form import closed_form
from gpukit.planning.facts import model_facts
from gpukit.runtime.strategy_at_setup import Question

WIDTH, BLOCKS, BATCH, STEPS = 32, 4, 4, 4


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, WIDTH, generator=g), torch.randn(32, 1, generator=g))


def _needs() -> dict[str, int]:
    """What the closed form says ddp and fsdp need per device on 2 CPUs (no overheads)."""
    facts = model_facts(_Net(), _data()[0])
    return {
        s: max(p.tensor_bytes for p in closed_form(facts, strategy=s, devices=2, micro_batch=BATCH))
        for s in ("ddp", "fsdp")
    }


def _question(capacity: int, loader: bool = True) -> Question:
    item = _data()[0]
    return Question(_Net(), 2, capacity, "cpu", BATCH if loader else 0, 1, "32", lambda: item)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["strategy"])
        return closed_form(*args, **kwargs)

    monkeypatch.setattr(auto, "closed_form", counting)
    return calls


def test_a_model_that_fits_keeps_ddp_for_one_closed_form_evaluation(counted: list[str]) -> None:
    answer = auto.answer(_question(_needs()["ddp"]))  # exactly at the device's size: fits
    assert (answer.shard, answer.said, counted) == (False, None, ["ddp"])


def test_a_model_ddp_cannot_fit_takes_fsdp_and_says_so(counted: list[str]) -> None:
    needs = _needs()
    answer = auto.answer(_question((needs["ddp"] + needs["fsdp"]) // 2))
    assert answer.shard and counted == ["ddp", "fsdp"]
    assert answer.said is not None
    assert answer.said.startswith("auto: ddp would need ") and "using fsdp" in answer.said
    assert "activations at 4 per micro-batch" in answer.said


def test_when_nothing_fits_ddp_stays_with_the_planners_figures(counted: list[str]) -> None:
    answer = auto.answer(_question(_needs()["fsdp"] - 1))
    assert not answer.shard and counted == ["ddp", "fsdp"]
    assert answer.said is not None and "neither fits" in answer.said
    assert "keeping ddp" in answer.said and "`gpukit plan`" in answer.said


def test_small_states_are_not_measured_and_no_data_counts_states_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[int] = []
    monkeypatch.setattr(auto, "model_facts", lambda *a, **k: measured.append(1))
    assert not auto.answer(_question(2**40)).shard  # far below the device: no forward
    assert measured == []
    answer = auto.answer(_question(1, loader=False))
    assert measured == [] and answer.said is not None and "no map-style DataLoader" in answer.said


def _run(rt: gk.Runtime, capacity: int | None, meta: bool = False) -> dict[str, Any]:
    """Set up with each device mocked at ``capacity`` bytes, then train, tracing the last steps
    (``meta``: the model built on the meta device, materialised by the strategy)."""
    if capacity is not None:
        rt.strategy.devices = [
            dataclasses.replace(d, total_memory=capacity) for d in rt.strategy.devices
        ]
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        model = _Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        model, optimizer, loader = rt.setup(model, optimizer, loader)
    losses = []
    batches = list(loader)
    for x, y in batches[:2]:  # first-step checks are one-time
        losses.append(
            rt.train_step(optimizer, (x, y), lambda b: nn.functional.mse_loss(model(b[0]), b[1]))
        )
    rt.flush_logs()
    with gk.trace() as t:
        for x, y in batches[2:STEPS]:
            loss = rt.train_step(
                optimizer, (x, y), lambda b: nn.functional.mse_loss(model(b[0]), b[1])
            )
            rt.log(loss=loss)
            losses.append(loss)
    return {
        "strategy": rt.strategy.name,
        "said": said.getvalue(),
        "reads": sum(s.count for s in t.syncs),
        "copies": len(t.transfers),
        "ops": t.ops_per_device,
        "losses": [float(v) for v in losses],
    }


@pytest.mark.processes
def test_a_model_that_fits_runs_the_same_ddp_with_the_same_per_step_cost() -> None:
    fits = _needs()["ddp"]
    chosen = gk.Runtime(strategy="auto", devices=["cpu", "cpu"], log_every=2).launch(_run, fits)
    plain = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], log_every=2).launch(_run, fits)
    assert chosen["strategy"] == "ddp" and chosen["said"] == ""
    assert chosen == plain


@pytest.mark.processes
@pytest.mark.parametrize("meta", [False, True])
def test_auto_takes_fsdp_on_every_rank_for_a_model_ddp_cannot_fit(meta: bool) -> None:
    needs = _needs()
    rt = gk.Runtime(strategy="auto", devices=["cpu", "cpu"], log_every=2, seed=0)
    got = rt.launch(_run, (needs["ddp"] + needs["fsdp"]) // 2, meta)
    assert got["strategy"] == "fsdp"
    assert got["said"].startswith("auto: ddp would need ") and "using fsdp" in got["said"]
    named = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], log_every=2, seed=0)
    sharded = named.launch(_run, None, meta)
    assert got["losses"] == sharded["losses"]  # the same training as fsdp asked for by name


@pytest.mark.processes
def test_auto_keeps_ddp_and_points_at_the_planner_when_nothing_fits() -> None:
    rt = gk.Runtime(strategy="auto", devices=["cpu", "cpu"], log_every=2)
    got = rt.launch(_run, _needs()["fsdp"] - 1)
    assert got["strategy"] == "ddp"
    assert "neither fits" in got["said"] and "gpukit plan" in got["said"]


class _Drawing(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose items draw random numbers (as random augmentations do)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(WIDTH), torch.randn(1)


def test_reading_the_example_leaves_every_random_generator_as_it_was() -> None:
    import random

    import numpy as np

    from gpukit.runtime.strategy_at_setup import _data

    read, micro = _data((DataLoader(_Drawing(), batch_size=4),), accumulate=2)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    item = read()
    assert micro == 2 and item[0].shape == (WIDTH,)
    drawn = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    assert (torch.rand(1), random.random(), np.random.rand()) == drawn


@pytest.mark.parametrize(
    ("argv", "given"),
    [([], "auto"), (["--strategy", "ddp"], "ddp"), (["--strategy", "fsdp"], "fsdp")],
)
def test_gpukit_train_lets_each_rank_decide_auto(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], given: str
) -> None:
    """The launcher's ranks get --strategy auto (each then asks the planner at setup), and
    an explicit strategy as it was given."""
    from gpukit.cli import train
    from gpukit.cli.__main__ import main

    commands: list[list[str]] = []
    monkeypatch.setattr(train, "run_job", lambda command, *a, **k: commands.append(command) or 0)
    assert main(["train", "--workload", "mlp", "--devices", "2", *argv]) == 0
    (command,) = commands
    assert command[command.index("--strategy") + 1] == given


@pytest.mark.processes
def test_oom_recover_keeps_ddp_without_asking() -> None:
    """Recovery over several ranks is ddp's alone: such a run is never switched."""
    needs = _needs()
    rt = gk.Runtime(strategy="auto", devices=["cpu", "cpu"], log_every=2, oom="recover")
    got = rt.launch(_run, (needs["ddp"] + needs["fsdp"]) // 2)
    assert (got["strategy"], got["said"]) == ("ddp", "")


def test_a_strategy_taken_at_setup_answers_the_lifecycles_agreements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The lifecycle agrees across ranks (when to save, where to stop) through the strategy:
    # once "auto" takes another one at rt.setup, the one it replaced must not be asked.
    rt = gk.Runtime(devices="cpu")
    asked: list[list[bool]] = []
    taken = copy.copy(rt.strategy)
    monkeypatch.setattr(taken, "any_rank", lambda votes: asked.append(votes) or votes)
    rt._use_strategy(taken)
    assert rt.strategy is taken and rt.lifecycle._agree([True]) == [True]
    assert asked == [[True]]


def test_a_strategy_taken_at_setup_reaches_every_part_that_holds_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The Runtime's parts (its metrics, evaluation, collectives, progress, profile, loggers,
    # checkpoints) each hold the strategy: once "auto" takes another one at rt.setup, none
    # keeps the old.
    rt = gk.Runtime(devices="cpu")
    old = rt.strategy
    taken = copy.copy(old)
    rt._use_strategy(taken)
    taken.rank = 1  # as rank 1 sees itself, where the replaced strategy still says rank 0
    rt.print("rank 0 only")
    assert capsys.readouterr().out == ""
    assert rt.progress(range(2), out=io.StringIO()).display is None  # nothing shown
    parts = (rt._metrics, rt._evaluation, rt._processes, rt._progress, rt._profiling)
    assert all(part.strategy is taken for part in (*parts, rt._reporting, rt._checkpointing))
    assert rt._profiling.stepper is rt._stepper and rt._stepper.strategy is taken
    assert rt._checkpointing.stepper is rt._stepper
    assert old.rank == 0
