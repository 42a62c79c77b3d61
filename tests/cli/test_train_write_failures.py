"""gpukit train when the disk refuses one of its files, for real: a folder put where
metrics.csv goes while the run trains (under the launcher, --max-restarts 2), a file-size
limit (RLIMIT_FSIZE: EFBIG), a full disk for metrics.json (``os.write`` made to fail as a full
disk does, in this process). Each: one message naming the file, the errno and the fix, exit
code 2 (1 from the launcher, which restarts nothing), and no half-written file.

These run as root in CI, and root ignores chmod: a read-only folder refuses nobody there, so
the refusals are ones root meets too (a folder in the way, a size limit, a patched os call)."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.cli.__main__ import main
from gpukit.train.report import read_history

SRC = str(Path(__file__).resolve().parents[2] / "src")
MLP = ["--workload", "mlp", "--log-every", "2"]


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    for name in ("RANK", "WORLD_SIZE", "GPUKIT_JOB_DIR", "GPUKIT_FAULT"):
        env.pop(name, None)
    return env


def _rows(path: Path) -> int:
    try:
        return path.read_text().count("\n")
    except OSError:
        return 0


@pytest.mark.processes
@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_folder_put_where_metrics_csv_goes_stops_the_run_and_is_not_restarted(
    tmp_path: Path, devices: str
) -> None:
    args = [*MLP, "--max-steps", "1000000", "--out", "run", "--max-restarts", "2"]
    args += ["--devices", devices]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "train", *args],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.csv"
    try:
        while _rows(metrics) < 3:  # the run has appended rows: it trains
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.05)
        os.rename(metrics, tmp_path / "run" / "metrics.csv.before")
        metrics.mkdir()  # its next append meets a folder: EISDIR
        output, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1, output  # the launcher's code for a rank that failed
    said = "could not write run/metrics.csv: a folder stands where the file goes (EISDIR)"
    assert output.count(f"gpukit train: error: {said}") == 1, output  # said once, in full
    assert "Fix: move that folder away, or give another folder" in output, output
    # Rank 0 writes the run's files: the failure is its own, another rank is not blamed.
    (first,) = [line for line in output.splitlines() if "the first failure" in line]
    assert first.startswith(f"gpukit train: rank 0 raised OutputWriteError: {said}"), output
    assert f"not restarted: rank 0 raised OutputWriteError: {said}" in output, output
    assert "restarting would fail the same way" in output, output
    assert "restart 1/2" not in output and "Traceback" not in output, output
    assert list(metrics.iterdir()) == []  # nothing was written into the folder in the way


@pytest.mark.processes
def test_a_file_size_limit_stops_the_run_with_efbig_and_whole_lines(tmp_path: Path) -> None:
    def limited() -> None:  # in the child, before it starts: every file at most 1200 bytes
        resource.setrlimit(resource.RLIMIT_FSIZE, (1200, 1200))

    env = _env()
    env.pop("GPUKIT_WARM_START", None)  # this process itself, under its limit
    # A row a step: metrics.csv passes the limit before the first checkpoint (step 32).
    args = ["--workload", "mlp", "--log-every", "1", "--out", "run"]
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", *args],
        executable=sys.executable,
        preexec_fn=limited,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    said = "could not write run/metrics.csv: the file would pass the largest size allowed"
    assert output.count(said) == 1, output
    assert "1.2 KiB at most (ulimit -f) (EFBIG)" in output, output
    assert "Fix: raise the limit (ulimit -f unlimited)" in output and "Traceback" not in output
    text = (tmp_path / "run" / "metrics.csv").read_text()
    assert text.endswith("\n") and len(text.encode()) <= 1200, text
    rows = read_history(tmp_path / "run" / "metrics.csv")  # whole rows only: it parses
    assert len(rows) > 5 and all("loss" in r for r in rows), rows
    assert not (tmp_path / "run" / "checkpoints" / "latest").exists()  # it stopped before
    assert not list((tmp_path / "run").glob(".*tmp-*"))


def test_a_full_disk_for_metrics_json_keeps_the_previous_one_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    train = ["train", *MLP, "--out", str(out), "--devices", "cpu"]
    assert main([*train, "--max-steps", "2"]) == 0
    before = (out / "metrics.json").read_text()
    assert json.loads(before)["steps"] == 2
    capsys.readouterr()

    write = os.write

    def full_for_metrics_json(fd: int, data: bytes | memoryview) -> int:
        if ".metrics.json.tmp-" not in os.readlink(f"/proc/self/fd/{fd}"):
            return write(fd, data)
        if len(data) > 16:  # half of it lands, as on a disk that fills up
            return write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_for_metrics_json)
    assert main([*train, "--max-steps", "4", "--resume"]) == 2
    said = capsys.readouterr().err
    assert said.count("could not write") == 1, said
    assert f"could not write {out}/metrics.json: the disk is full (ENOSPC)" in said, said
    assert "the previous file is still there, whole" in said and "Fix: free space" in said
    assert (out / "metrics.json").read_text() == before  # the old one, whole: it parses
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert not list(out.glob(".*tmp-*"))
