"""Finding the job `gpukit top` watches, and each way there is none: one clear line each."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from gpukit.errors import ConfigError
from gpukit.watch.jobs import LIVE_FILE, OUT_JOB_FILE, STALE_S, find_job, read_view, stopped
from tests.watch.live_views import job_folder, publish, two_nodes

# A pid no process has: pids stay below /proc/sys/kernel/pid_max (at most 2**22).
GONE_PID = 2**22 + 7


def running(where: Path, **fields: object) -> Path:
    folder = job_folder(where)
    publish(folder, two_nodes(updated=time.time(), **fields))
    return folder


def test_the_one_running_job_is_found_under_the_temp_folder(tmp_path: Path) -> None:
    folder = running(tmp_path)
    assert find_job(where=str(tmp_path)) == folder


def test_job_folders_without_a_view_or_of_dead_launchers_are_not_running(tmp_path: Path) -> None:
    folder = running(tmp_path)
    job_folder(tmp_path / "a", pid=None).rename(tmp_path / "gpukit-job-1-noview")  # no live.json
    dead = job_folder(tmp_path / "b", pid=GONE_PID)
    publish(dead, two_nodes(updated=time.time() - 60, launcher_pid=GONE_PID))
    dead.rename(tmp_path / dead.name)
    assert find_job(where=str(tmp_path)) == folder


def test_no_job_running_says_where_it_looked_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no gpukit job is running on this machine") as err:
        find_job(where=str(tmp_path))
    assert str(tmp_path) in str(err.value) and "--job DIR or --out OUT" in str(err.value)


def test_a_running_job_without_a_view_yet_is_said_apart_from_no_job(tmp_path: Path) -> None:
    folder = job_folder(tmp_path)  # its launcher (this process) runs, and wrote no view yet
    with pytest.raises(ConfigError, match="no gpukit job here publishes its view yet") as err:
        find_job(where=str(tmp_path))
    assert f"--job DIR ({folder})" in str(err.value)


def test_several_jobs_are_listed_with_their_command_and_start_time(tmp_path: Path) -> None:
    first = running(tmp_path / "one")
    first = first.rename(tmp_path / "gpukit-job-1-a")
    second = running(tmp_path / "two")
    second = second.rename(tmp_path / "gpukit-job-2-b")
    with pytest.raises(ConfigError, match="2 gpukit jobs are running") as err:
        find_job(where=str(tmp_path))
    lines = str(err.value).splitlines()
    assert "choose one with --job DIR" in lines[0]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(two_nodes()["started"]))
    assert lines[1:] == [
        f"  {folder}  started {started}  gpukit train --workload gpt --nnodes 2 --devices 2"
        for folder in (first, second)
    ]


def test_job_given_is_taken_as_it_is(tmp_path: Path) -> None:
    folder = running(tmp_path)
    assert find_job(job=str(folder)) == folder


def test_job_that_is_no_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--job .*missing: no such folder.*may have ended"):
        find_job(job=str(tmp_path / "missing"))


def test_job_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="that is a file, not a job folder"):
        find_job(job=str(tmp_path / "f"))


def test_job_that_is_a_folder_of_something_else(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"not a gpukit job folder \(it holds no {LIVE_FILE}\)"):
        find_job(job=str(tmp_path))


def test_job_that_ended(tmp_path: Path) -> None:
    folder = running(tmp_path, ended={"time": time.time(), "code": 0, "how": "finished"})
    with pytest.raises(ConfigError, match=r"the job ended: finished \(exit code 0\) at \d\d:"):
        find_job(job=str(folder))


def test_job_whose_launcher_is_gone_and_whose_view_is_stale(tmp_path: Path) -> None:
    folder = job_folder(tmp_path)
    publish(folder, two_nodes(updated=time.time() - 3 * STALE_S, launcher_pid=GONE_PID))
    with pytest.raises(ConfigError, match=rf"launcher \(pid {GONE_PID}\) is gone and live.json"):
        find_job(job=str(folder))


def test_a_fresh_view_of_a_gone_launcher_still_runs_for_a_few_seconds(tmp_path: Path) -> None:
    """The launcher may be between two checks of its own: only a view that stopped changing
    for STALE_S seconds says it is gone."""
    folder = job_folder(tmp_path)
    view = two_nodes(updated=time.time(), launcher_pid=GONE_PID)
    assert stopped(folder, view) is None
    assert stopped(folder, view, now=time.time() + 2 * STALE_S) is not None


def test_job_folder_of_a_killed_launcher_without_a_view(tmp_path: Path) -> None:
    folder = job_folder(tmp_path, pid=GONE_PID)
    with pytest.raises(ConfigError, match=r"launcher \(pid \d+\) is gone and it holds no live"):
        find_job(job=str(folder))


def test_out_follows_its_job_file(tmp_path: Path) -> None:
    folder = running(tmp_path / "tmp")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / OUT_JOB_FILE).write_text(f"{folder}\n")
    assert find_job(out=str(tmp_path / "out")) == folder


def test_out_that_is_no_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--out .*: no such folder: give the --out folder"):
        find_job(out=str(tmp_path / "missing"))


def test_out_that_is_no_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not the --out folder of a gpukit train run"):
        find_job(out=str(tmp_path))


def test_out_of_a_run_that_ended(tmp_path: Path) -> None:
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(ConfigError, match="no job is running for this run"):
        find_job(out=str(tmp_path))


def test_out_of_a_running_run_of_one_process_says_it_has_no_live_view(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text("")
    (tmp_path / ".gpukit.lock").write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": "2026-11-29 15:00:00",
                "command": "gpukit train --workload mlp",
            }
        )
    )
    with pytest.raises(
        ConfigError, match=r"one process, not under gpukit's launcher .*--devices N"
    ):
        find_job(out=str(tmp_path))


def test_out_whose_job_folder_is_gone(tmp_path: Path) -> None:
    (tmp_path / OUT_JOB_FILE).write_text(str(tmp_path / "gpukit-job-1-gone"))
    with pytest.raises(ConfigError, match=r"the run's job has ended: its folder .* is gone"):
        find_job(out=str(tmp_path))


def test_out_shared_by_the_nodes_read_where_the_job_folder_is_not(tmp_path: Path) -> None:
    # OUT on a shared disk, read on node 1: OUT/job names node 0's folder, on node 0's disk.
    (tmp_path / OUT_JOB_FILE).write_text("/tmp/gpukit-job-4242-x1y2z3\n")
    (tmp_path / ".gpukit.lock").write_text(
        '{"pid": 4242, "host": "node-a", "started": "2026-11-29 10:00:00", '
        '"command": "gpukit train"}'
    )
    with pytest.raises(ConfigError) as refused:
        find_job(out=str(tmp_path))
    said = str(refused.value)
    assert "is on host node-a, whose pid 4242 on host node-a since" in said
    assert "run gpukit top there, or `gpukit top` alone on a node of the job" in said
    assert "ended" not in said


@pytest.mark.parametrize("text", ["", '{"step": 4', "[1, 2]", "\xff\xfe"])
def test_a_view_half_written_or_unreadable_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / LIVE_FILE).write_text(text, encoding="latin-1")
    assert read_view(tmp_path) is None
