"""The launcher's job folder when the launcher is killed (SIGKILL: it cannot clean up): the
next launcher removes it, saying so, once no live process owns it; a live launcher's folder and
a kept hang report are left alone. Real processes, a real SIGKILL, in a temporary folder of the
test's own (TMPDIR)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpukit.launch import job_folders
from gpukit.launch.hang_reports import REPORT_FILE

pytestmark = [pytest.mark.processes, pytest.mark.cold_start]  # the launcher's own pid

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _launch(tmp: Path, script: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp)}
    for name in ("RANK", "WORLD_SIZE", "GPUKIT_JOB_DIR", "GPUKIT_WARM_START"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "gpukit", "launch", "--nproc", "1", str(script)],
        executable=sys.executable,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_killed_launchers_folder_is_removed_by_the_next_one(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started = tmp_path / "started"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(f"import time\nopen({str(started)!r}, 'w').close()\ntime.sleep(600)\n")
    kept = tmp / "gpukit-job-999999999-hang"  # a dead launcher's hang report: kept for the user
    kept.mkdir()
    (kept / REPORT_FILE).write_text("attempt 0\n")
    (kept / job_folders.OWNER_FILE).touch()

    first = _launch(tmp, sleeper)
    try:
        while not started.exists():
            assert first.poll() is None, first.communicate()[0]
            time.sleep(0.05)
        (folder,) = tmp.glob(f"gpukit-job-{first.pid}-*")
        assert job_folders.sweep(tmp) == [] and folder.is_dir()  # its launcher lives
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
        first.communicate()
    assert folder.is_dir()  # a killed launcher cannot remove its own

    done = tmp_path / "done.py"
    done.write_text("print('ran')\n")
    second = _launch(tmp, done)
    output = second.communicate(timeout=240)[0]
    assert second.returncode == 0, output
    assert f"gpukit launch: removed {folder}, left by a launcher that was killed" in output
    assert not folder.exists()
    assert [p.name for p in tmp.iterdir()] == [kept.name]  # and its own folder is gone too
