"""`gpukit bench speed`: gpt2 through gpukit train's loop, gk.Runtime and a nanoGPT-style plain
loop, side by side; the same training in each (checked loss by loss); what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.bench import speed
from gpukit.bench import speed_loops as loops
from gpukit.bench.result import BenchResult
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError

CPU = torch.device("cpu")


def test_quick_run_compares_the_three_loops_on_the_same_training(quick_speed: BenchResult) -> None:
    rows = {row["variant"]: row for row in quick_speed.rows}
    assert list(rows) == ["nanogpt", "runtime", "train"]
    assert rows["nanogpt"]["ratio"] == 1.0
    for row in rows.values():
        assert row["device"] == "cpu" and row["tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["mfu"] is None and row["peak_memory"] is None  # a CPU has neither
        # float32 without compiling: the same computation, loss for loss.
        assert row["loss_delta"] == 0.0 and row["status"] == "ok"
    (raw,) = quick_speed.raw["devices"]
    first = raw["first_losses"]
    assert len(first["nanogpt"]) == 10 and first["train"] == first["runtime"] == first["nanogpt"]
    # Every loop read its loss back at the same steps: once per call of 10 steps. The copies
    # taking turns (3 on a CPU) each make a first call; the first copy also the warm-up call.
    # The plain loop reads the step's loss, gpukit the mean of 10.
    read = raw["losses_read_back"]
    assert [len(v) for v in read.values()] == [2, 2, 2] and read["train"] == read["runtime"]
    assert raw["tokens_per_step"] == 4 * 64 and set(raw["seconds_per_step_by_round"]) == set(rows)
    data = json.loads(json.dumps(quick_speed.to_dict(), default=str))
    assert BenchResult.from_dict(data).rows == quick_speed.rows


def test_the_plot_is_drawn_from_the_stored_result(quick_speed: BenchResult, tmp_path: Path) -> None:
    speed.plot(quick_speed, tmp_path / "speed.png")
    assert (tmp_path / "speed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_loop_that_trains_differently_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    def other_weights(setup: loops.Setup, batches: list[loops.Batch]) -> loops.Loop:
        monkeypatch.setattr(loops, "SEED", 1)  # this loop's model alone starts elsewhere
        try:
            return loops.train_loop(setup, batches)
        finally:
            monkeypatch.setattr(loops, "SEED", 0)

    monkeypatch.setitem(loops.BUILDERS, "train", other_weights)
    rows = {r["variant"]: r for r in speed.run(quick=True, rounds=1).rows}
    assert rows["runtime"]["status"] == "ok"
    assert rows["train"]["status"] == "losses differ from nanogpt's"
    assert rows["train"]["loss_delta"] > 0


def test_each_loop_reads_back_once_per_log_interval_and_nothing_more() -> None:
    # Each loop reads its loss back every log_every steps (gpukit train's 10) and nothing
    # more; its first call also reads the losses it kept, after its steps, once.
    setup = loops.Setup(CPU, loops.TINY, batch=2, compile=False)
    assert setup.log_every == 10
    batches = loops.make_batches(setup, 10)
    for name, build in loops.BUILDERS.items():
        loop = build(setup, batches)
        loop(batches)
        with gk.trace() as t:
            loop(batches)
        assert len(loop.losses) == 2 and len(loop.first) == 10, name
        assert sum(s.count for s in t.syncs) == 1, (name, [(s.op, s.function) for s in t.syncs])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps=0: give a whole number of at least 1"),
        ({"rounds": -1}, "rounds=-1: give a whole number of at least 1"),
        ({"devices": [torch.device("cuda", 7)]}, "cuda:7"),
    ],
)
def test_bad_counts_and_devices_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        speed.run(quick=True, **kwargs)  # type: ignore[arg-type]


def test_the_command_refuses_a_bad_count_before_measuring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "speed", "--quick", "--steps", "0"]) != 0
    assert "--steps 0: give a whole number of at least 1" in capsys.readouterr().err
