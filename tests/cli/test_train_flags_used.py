"""`gpukit train` flags that would be accepted and then ignored are refused or made to work."""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.cli import train
from gpukit.cli.__main__ import main

RUN = ["train", "--workload", "mlp", "--max-steps", "1"]


def test_overwrite_without_out_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*RUN, "--overwrite"]) == 2
    assert "--overwrite needs --out DIR" in capsys.readouterr().err


def test_a_hang_timeout_for_one_process_runs_it_under_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[dict[str, Any]] = []

    def run_job(command: list[str], nproc: int, **options: Any) -> int:
        started.append({"command": command, "nproc": nproc, **options})
        return 0

    monkeypatch.setattr(train, "run_job", run_job)
    assert main([*RUN, "--devices", "cpu", "--hang-timeout", "60"]) == 0
    (job,) = started
    assert job["nproc"] == 1 and job["hang_timeout"] == 60.0
    assert job["command"][job["command"].index("--strategy") + 1] == "single"
    started.clear()
    assert main([*RUN, "--devices", "cpu", "--hang-timeout", "0"]) == 0  # 0: never watched
    assert started == []
    flags = ["--hang-timeout", "60", "--startup-timeout", "1200"]
    assert main([*RUN, "--devices", "cpu", *flags]) == 0
    assert started[0]["startup_timeout"] == 1200.0  # passed through to the launcher


def test_a_startup_timeout_that_is_not_seconds_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*RUN, "--startup-timeout", "-1"]) == 2
    assert "--startup-timeout -1.0: give seconds, 0 or more" in capsys.readouterr().err


def test_restarts_or_a_hang_watch_with_dp_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (["--max-restarts", "1"], ["--hang-timeout", "60"]):
        args = [*RUN, "--strategy", "dp", "--devices", "cpu,cpu", *flags]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "drives every device from one process" in err and "--strategy ddp" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--straggler-factor", "1"], "--straggler-factor 1: give a number over 1"),
        (["--straggler-factor", "slow"], "--straggler-factor slow: give a number over 1"),
        (["--straggler-steps", "-2"], "--straggler-steps -2: give a whole number of steps"),
        (["--straggler-steps", "ten"], "--straggler-steps ten: give a whole number of steps"),
    ],
)
def test_straggler_settings_that_cannot_work_are_refused(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main([*RUN, *flags]) == 2
    assert message in capsys.readouterr().err


def test_the_launcher_gets_the_straggler_settings_the_out_folder_and_the_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    started: list[dict[str, Any]] = []

    def run_job(command: list[str], nproc: int, **options: Any) -> int:
        started.append(options)
        return 0

    monkeypatch.setattr(train, "run_job", run_job)
    flags = ["--hang-timeout", "60", "--straggler-factor", "1.5", "--straggler-steps", "0"]
    assert main([*RUN, "--devices", "cpu", "--out", str(tmp_path / "o"), *flags]) == 0
    (job,) = started
    assert job["straggler_factor"] == 1.5 and job["straggler_steps"] == 0
    assert job["record_dir"] == str(tmp_path / "o") and job["total_steps"] == 1
