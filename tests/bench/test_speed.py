"""`gpukit bench speed`: gpt2 through gpukit train's loop, gk.Runtime and a nanoGPT-style plain
loop, and Llama's shape under FSDP2 through the same two and a torchtitan-style plain loop, side
by side; the same training in each (checked loss by loss); what it refuses."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.bench import speed, speed_fsdp
from gpukit.bench import speed_loops as loops
from gpukit.bench.result import BenchResult
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError

CPU = torch.device("cpu")


def test_quick_run_compares_the_three_loops_on_the_same_training(quick_speed: BenchResult) -> None:
    rows = {(row["model"], row["variant"]): row for row in quick_speed.rows}
    assert list(rows) == [
        ("gpt2", "nanogpt"),
        ("gpt2", "runtime"),
        ("gpt2", "train"),
        ("llama", "fsdp2"),
        ("llama", "runtime"),
        ("llama", "train"),
    ]
    assert rows["gpt2", "nanogpt"]["ratio"] == rows["llama", "fsdp2"]["ratio"] == 1.0
    for row in rows.values():
        assert row["device"] == "cpu" and row["tokens_per_s"] > 0 and row["ratio"] > 0
        assert row["mfu"] is None and row["peak_memory"] is None  # a CPU has neither
        # float32 without compiling: the same computation, loss for loss.
        assert row["loss_delta"] == 0.0 and row["status"] == "ok"
    gpt2_raw, llama_raw = quick_speed.raw["devices"]
    assert (gpt2_raw["reference"], llama_raw["reference"]) == ("nanogpt", "fsdp2")
    first = gpt2_raw["first_losses"]
    assert len(first["nanogpt"]) == 10 and first["train"] == first["runtime"] == first["nanogpt"]
    first = llama_raw["first_losses"]
    assert len(first["fsdp2"]) == 10 and first["train"] == first["runtime"] == first["fsdp2"]
    # Every loop read its loss back at the same steps: once per call of 10 steps. The copies
    # taking turns (3 on a CPU) each make a first call; the first copy also the warm-up call.
    # The plain loop reads the step's loss, gpukit the mean of 10.
    for raw in (gpt2_raw, llama_raw):
        read = raw["losses_read_back"]
        assert [len(v) for v in read.values()] == [2, 2, 2] and read["train"] == read["runtime"]
        assert set(raw["seconds_per_step_by_round"]) == set(raw["first_losses"])
    assert gpt2_raw["tokens_per_step"] == llama_raw["tokens_per_step"] == 4 * 64
    assert not torch.distributed.is_initialized()  # the group llama's loops used is gone
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
    result = speed.run(quick=True, rounds=1)
    rows = {r["variant"]: r for r in result.rows if r["model"] == "gpt2"}
    assert rows["runtime"]["status"] == "ok"
    assert rows["train"]["status"] == "losses differ from nanogpt's"
    assert rows["train"]["loss_delta"] > 0


@pytest.mark.parametrize("model", speed.MODELS)
def test_each_loop_reads_back_once_per_log_interval_and_nothing_more(model: str) -> None:
    # Each loop reads its loss back every log_every steps (gpukit train's 10) and nothing
    # more; its first call also reads the losses it kept, after its steps, once.
    sizes = speed_fsdp.TINY if model == "llama" else loops.TINY
    setup = loops.Setup(CPU, sizes, batch=2, compile=False, model=model, seq_len=16)
    assert setup.log_every == 10
    batches = loops.make_batches(setup, 10)
    group = speed_fsdp.process_group(CPU) if model == "llama" else contextlib.nullcontext()
    with group, contextlib.redirect_stdout(io.StringIO()):
        for name, build in speed.BUILDERS[model].items():
            loop = build(setup, batches)
            loop(batches)
            with gk.trace() as t:
                loop(batches)
            loop.close()
            assert len(loop.losses) == 2 and len(loop.first) == 10, name
            syncs = [(s.op, s.function) for s in t.syncs]
            assert sum(s.count for s in t.syncs) == 1, (name, syncs)


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
