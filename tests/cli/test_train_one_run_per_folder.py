"""gpukit train as users start it, twice into one folder and onto a disk that fills up: real
processes, real locks, a real small file system (a tmpfs; skipped where it cannot be mounted)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit.checkpoint import lock as folder_lock

pytestmark = pytest.mark.processes

SRC = str(Path(__file__).resolve().parents[2] / "src")
MLP = ["--workload", "mlp", "--log-every", "2"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    for name in ("RANK", "WORLD_SIZE", "GPUKIT_JOB_DIR", "GPUKIT_FAULT"):
        env.pop(name, None)
    return env


def _gpukit(args: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def running(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A long `gpukit train --out run`, once it holds run/ and its checkpoints. Started cold
    (``executable`` keeps the warm start's wrapper off it): the refusal names the holder by
    the pid of the process this test started."""
    env = _env()
    env.pop("GPUKIT_WARM_START", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "train", *MLP, "--max-steps", "100000", "--out", "run"],
        executable=sys.executable,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lock = tmp_path / "run" / "checkpoints" / folder_lock.LOCK_FILE
    for _ in range(600):
        if lock.is_file() and lock.read_text().strip():
            break
        assert proc.poll() is None, "the first run ended early"
        time.sleep(0.1)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(folder_lock.fcntl is None, reason="no fcntl: folders are not locked")
def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_one_frees_it(
    tmp_path: Path, running: subprocess.Popen[str]
) -> None:
    code, output = _gpukit([*MLP, "--max-steps", "2", "--out", "run"], tmp_path)
    assert code == 2, output
    assert f"run is in use by pid {running.pid} on host " in output, output
    assert "(gpukit train): wait for it, stop it, or use another --out" in output, output
    assert "Traceback" not in output
    running.send_signal(signal.SIGKILL)  # the kernel frees its locks
    running.wait()
    code, output = _gpukit([*MLP, "--max-steps", "2", "--out", "run", "--overwrite"], tmp_path)
    assert code == 0, output


@pytest.mark.slow
def test_a_launched_job_runs_under_its_own_lock_and_resumes_into_the_folder_after_it(
    tmp_path: Path,
) -> None:
    args = [*MLP, "--devices", "2", "--out", "run", "--save-every", "2"]
    code, output = _gpukit([*args, "--max-steps", "4", "--max-restarts", "1"], tmp_path)
    assert code == 0, output  # the launcher holds run/, rank 0 run/checkpoints: no conflict
    assert not (tmp_path / "run" / folder_lock.LOCK_FILE).exists()  # given back at the end
    code, output = _gpukit([*args, "--max-steps", "6", "--resume"], tmp_path)
    assert code == 0, output
    latest = tmp_path / "run" / "checkpoints" / "latest"
    assert latest.read_text().strip() == "step-00000006"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB file system of its own (a tmpfs: needs root, as CI has)."""
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'not root'})")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _leave_free(disk: Path, leave: int) -> None:
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def _after_failed_save(out: Path, output: str) -> None:
    """A few checkpoints fit the space left; then a save fails: one clear error, nothing left
    of it, and ``latest`` names the checkpoint before it."""
    found = re.search(r"could not write the checkpoint of step (\d+) in run/checkpoints", output)
    assert found is not None, output
    assert "the disk is full (ENOSPC)" in output and "needs about" in output, output
    assert "Traceback" not in output, output
    checkpoints = out / "checkpoints"
    step = int(found.group(1))
    assert step > 2, output  # the first one fitted
    assert (checkpoints / "latest").read_text().strip() == f"step-{step - 2:08d}"
    assert not list(checkpoints.glob(".tmp*")), list(checkpoints.iterdir())


def test_a_periodic_save_on_a_full_disk_stops_the_run_with_one_error(small_disk: Path) -> None:
    _leave_free(small_disk, 250_000)
    code, output = _gpukit(
        [*MLP, "--max-steps", "20", "--out", "run", "--save-every", "2"], small_disk
    )
    assert code == 2, output
    assert output.count("could not write the checkpoint") == 1, output
    _after_failed_save(small_disk / "run", output)


@pytest.mark.slow
def test_a_failed_save_under_two_ranks_ends_the_job_and_is_not_restarted(
    small_disk: Path,
) -> None:
    _leave_free(small_disk, 250_000)
    two = ["--devices", "2", "--max-restarts", "2"]
    args = [*MLP, *two, "--max-steps", "20", "--out", "run", "--save-every", "2"]
    code, output = _gpukit(args, small_disk)
    # Said once for the job, as one process says it (exit 2), and never restarted.
    assert code == 2, output
    assert output.count("could not write the checkpoint") == 1, output
    assert "restart 1/2" not in output, output
    _after_failed_save(small_disk / "run", output)
