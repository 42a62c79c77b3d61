"""`gpukit bench restarts`: the phases of a restart and of the cold start, from the ranks'
marks and the launcher's attempts, computed on made-up times (the real job runs in
tests/bench/test_suite.py's `bench all --quick`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.bench import restarts
from gpukit.bench.restart_rank import MARKS
from gpukit.launch import RUNNER


def write_marks(folder: Path, attempt: int, start: float, slow_rank: int) -> None:
    for rank in range(restarts.NPROC):
        extra = 0.5 if rank == slow_rank else 0.0
        marks = {name: start + i + extra * (name == "torch") for i, name in enumerate(MARKS)}
        (folder / f"marks-{rank}-{attempt}.json").write_text(json.dumps(marks))


def test_phases_of_the_cold_start_and_of_the_restart(tmp_path: Path) -> None:
    first = {
        "attempt": 0,
        "started": 99.5,
        "all_beaten": 103.2,
        "first_step": 106.1,
        "failed": 110.0,
        "gone": 111.0,
    }
    second = {
        "attempt": 1,
        "started": 111.25,
        "all_beaten": 115.0,
        "first_step": 118.0,
        "failed": None,
        "gone": None,
    }
    write_marks(tmp_path, 0, 100.0, slow_rank=1)
    write_marks(tmp_path, 1, 112.0, slow_rank=0)
    cold = restarts._phases(tmp_path, first, None)
    again = restarts._phases(tmp_path, second, first)
    assert cold["stop"] is None and cold["relaunch"] is None
    assert cold["python start"] == 0.5 and cold["import torch"] == 1.5  # the slowest rank's
    assert cold["import gpukit"] == 1.0 and cold["process group"] == 1.0
    assert cold["total"] == 106.0 - 99.5  # the marks' first step, not the beats'
    assert again["stop"] == 1.0 and again["relaunch"] == 0.25
    assert again["total"] == 118.0 - 110.0
    assert again["first beat → first step"] == pytest.approx(3.0)
    assert [name for name, _ in restarts.PHASES][-1] == "total"


def test_each_rank_runs_gpukit_train_through_the_runner_and_the_marking_script() -> None:
    command = restarts.command(steps=4)
    assert command[1:3] == [str(RUNNER), str(Path(restarts.restart_rank.__file__).resolve())]
    assert command[3:] == ["train", "--workload", "mlp", "--strategy", "ddp", "--max-steps", "4"]
