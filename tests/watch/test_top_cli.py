"""`gpukit top` from the command line: its options, its modes, its one-line errors, and that
it only reads: nothing opened for writing, and a job watched and killed under it runs on."""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpukit.cli.__main__ import main
from gpukit.watch.jobs import LIVE_FILE, STALE_S
from gpukit.watch.live import watch
from tests.watch.live_views import Publisher, job_folder, publish, two_nodes


@pytest.fixture
def job(tmp_path: Path) -> Path:
    folder = job_folder(tmp_path)
    publish(folder, two_nodes(updated=time.time()))
    return folder


GONE_PID = 2**22 + 7  # above any pid_max: no process has it


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines()]


def test_help_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["top", "--help"])
    assert done.value.code == 0
    manual = capsys.readouterr().out
    assert "Example:\n    gpukit top\n    gpukit top --out runs/gpt" in manual
    assert "q or Ctrl-C quits" in manual


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf"])
def test_an_interval_that_is_no_positive_number_is_refused(
    job: Path, interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", "--job", str(job), "--interval", interval]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit top: error: --interval {interval}: give the seconds")
    assert len(err.splitlines()) == 1


def test_job_and_out_together_are_refused(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["top", "--job", str(job), "--out", str(job)])
    assert done.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_no_job_running_is_one_line_and_exit_code_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["top"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpukit top: error: no gpukit job is running on this machine")
    assert len(err.splitlines()) == 1


def test_once_prints_one_screen(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", "--job", str(job), "--once"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpukit train  2 nodes x 2 ranks  step 37/200 (18%)\n")
    assert "   0   1 slow     40   61 / 61 ms" in out


@pytest.mark.parametrize("columns", [100, 120])
def test_once_off_a_terminal_is_as_wide_as_columns_says(
    job: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: int
) -> None:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["top", "--job", str(job), "--once"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gpukit train  2 nodes x 2 ranks  step 37/200 (18%)"
    assert max(map(len, lines)) <= columns
    assert any(line.startswith("   0   1 slow     40") for line in lines)


def test_once_retries_a_view_being_written(job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (job / LIVE_FILE).write_text('{"step": 4')
    with Publisher(job, period=0.3):  # its next write is whole
        assert main(["top", "--job", str(job), "--once"]) == 0
    assert "2 nodes x 2 ranks" in capsys.readouterr().out


def test_json_prints_one_view_per_interval_until_the_job_ends(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Publisher(job, period=0.05, ends_at=44):
        assert main(["top", "--job", str(job), "--json", "--interval", "0.02"]) == 0
    captured = capsys.readouterr()
    views = json_lines(captured.out)
    steps = [max(r["step"] for r in view["ranks"]) for view in views]
    assert steps == sorted(steps) and steps[0] >= 40 and steps[-1] == 44
    assert views[-1]["ended"]["how"] == "finished"
    assert all({"rank", "step"} <= set(r) for view in views for r in view["ranks"])
    assert captured.err == "gpukit top: the job ended: finished (exit code 0) at " + time.strftime(
        "%H:%M:%S\n", time.localtime(views[-1]["ended"]["time"])
    )


def test_json_skips_an_unreadable_view_and_reads_the_next(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (job / LIVE_FILE).write_text("{not json")
    with Publisher(job, period=0.1, ends_at=42):
        assert main(["top", "--job", str(job), "--json", "--interval", "0.02"]) == 0
    assert json_lines(capsys.readouterr().out)  # every line a whole view


def test_a_job_folder_that_goes_away_ends_the_watch(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    threading.Timer(0.2, shutil.rmtree, [job]).start()
    assert watch(job, interval=0.02, mode="json") == 0
    said = f"the job ended: its folder {job} is gone (a launcher removes it at the end)"
    assert capsys.readouterr().err == f"gpukit top: {said}\n"


def test_a_launcher_gone_with_its_view_stale_ends_the_watch_with_exit_code_1(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    killed = two_nodes(updated=time.time() - 2 * STALE_S, launcher_pid=GONE_PID)
    threading.Timer(0.2, publish, [job, killed]).start()
    assert watch(job, interval=0.02, mode="json") == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"gpukit top: the job stopped without ending: its launcher (pid {GONE_PID}) is gone"
    )


def test_off_a_terminal_each_interval_prints_a_screen(
    job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Publisher(job, period=0.05, ends_at=42):
        assert main(["top", "--job", str(job), "--interval", "0.02"]) == 0
    assert capsys.readouterr().out.count("gpukit train  2 nodes x 2 ranks") >= 2


@contextlib.contextmanager
def opened_for_writing(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every file opened for writing in the block, by open() or os.open()."""
    found: list[str] = []
    real_open, real_os_open = builtins.open, os.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def checked_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+"):
            found.append(f"{file} ({mode})")
        return real_open(file, mode, *args, **kwargs)

    def checked_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & writes:
            found.append(f"{path} (flags {flags:#o})")
        return real_os_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", checked_open)
        patch.setattr(io, "open", checked_open)
        patch.setattr(os, "open", checked_os_open)
        yield found


def test_top_opens_nothing_for_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    running = job_folder(tmp_path)
    publish(running, two_nodes(updated=time.time()))
    ended = job_folder(tmp_path / "other", pid=1)
    publish(ended, two_nodes(updated=time.time(), ended={"time": time.time(), "code": 0}))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with opened_for_writing(monkeypatch) as found:
        assert main(["top", "--once"]) == 0  # finds the running job
        assert main(["top", "--job", str(running), "--once"]) == 0
        assert main(["top", "--job", str(ended), "--once"]) == 2  # it ended
        assert main(["top", "--out", str(tmp_path / "no-run")]) == 2
        assert watch(ended, interval=0.01, mode="json") == 0
    assert found == []


# --- a real job, watched and then killed under it ------------------------------------------------

RANK = """
import sys, time, torch, gpukit as gk
from pathlib import Path
stop = Path(sys.argv[1]) / "stop"
rt = gk.Runtime(strategy="ddp", devices="cpu", seed=0)
net = torch.nn.Linear(4, 1)
model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
step = 0
while step < 3000:
    rt.backward(model(torch.ones(2, 4)).sum())
    rt.step(optimizer)
    step += 1
    time.sleep(0.02)
    if step % 10 == 0 and rt.all_reduce(float(stop.exists()), op="max"):
        break  # every rank leaves at the same step
Path(sys.argv[1], f"rank{rt.rank}").write_text(str(step))
rt.teardown()
"""


def _steps_seen(top: subprocess.Popen[str], count: int) -> list[int]:
    """The job's step in ``count`` of ``gpukit top --json``'s lines, once its ranks beat."""
    assert top.stdout is not None
    seen: list[int] = []
    while len(seen) < count:
        step = json.loads(top.stdout.readline())["step"]
        if isinstance(step, int) and step > 0:
            seen.append(step)
    return seen


def _step(live: Path) -> int:
    """The step in the launcher's view; 0 while it is being replaced or not yet known."""
    try:
        step = json.loads(live.read_text())["step"]
    except (OSError, ValueError):
        return 0
    return step if isinstance(step, int) else 0


@pytest.mark.processes
def test_killing_top_leaves_the_job_it_watched_running(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(RANK)
    run = [sys.executable, "-m", "gpukit"]
    # The launcher's job folder and the one gpukit top looks for lie under this TMPDIR.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    job = subprocess.Popen(  # cold (executable=): a warm server keeps its own TMPDIR
        [*run, "launch", "--nproc", "2", str(script), str(tmp_path)],
        executable=sys.executable,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    top = None
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(f"gpukit-job-*/{LIVE_FILE}")):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.1)
        (live,) = tmp_path.glob(f"gpukit-job-*/{LIVE_FILE}")
        # Started cold (executable=), so that SIGKILL reaches gpukit top itself, not the
        # warm-start client that would stand for it.
        top = subprocess.Popen(
            [*run, "top", "--json", "--interval", "0.1"],
            executable=sys.executable,
            text=True,
            stdout=subprocess.PIPE,
            env=env,
        )
        seen = _steps_seen(top, 3)
        assert seen == sorted(seen), seen
        top.send_signal(signal.SIGKILL)
        assert top.wait(timeout=30) == -signal.SIGKILL
        before = _step(live)
        while _step(live) <= before:  # the job steps on
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
            time.sleep(0.05)
        (tmp_path / "stop").touch()
        output, _ = job.communicate(timeout=120)
        assert job.returncode == 0, output
        steps = [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)]
        assert steps[0] == steps[1] > before
    finally:
        for process in (top, job):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)


# --- the terminal, on every way out --------------------------------------------------------------


@pytest.mark.parametrize("how", ["q", "SIGTERM", "SIGHUP", "error"])
def test_the_terminal_is_put_back_however_the_keys_stop_being_read(how: str) -> None:
    """On a pseudo-terminal: cbreak mode (no echo, keys one by one) while the loop reads keys,
    and the settings as they were once it ends, be it by q, a signal or an error."""
    import termios

    from gpukit.watch import live

    leader, follower = os.openpty()
    try:
        before = termios.tcgetattr(follower)
        handlers = [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)]
        with (
            open(follower, closefd=False) as stream,
            contextlib.suppress(KeyboardInterrupt, RuntimeError),
            live._keys(stream) as wait,
        ):
            during = termios.tcgetattr(follower)
            assert not during[3] & (termios.ICANON | termios.ECHO)
            if how == "q":
                os.write(leader, b"xq")
                assert wait(30.0) is True
            elif how == "error":
                raise RuntimeError("a bug")
            else:
                os.kill(os.getpid(), getattr(signal, how))
                wait(30.0)  # the signal ends the wait
                pytest.fail("the signal did not interrupt the wait")
        assert termios.tcgetattr(follower) == before
        assert [signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)] == handlers
    finally:
        os.close(leader)
        os.close(follower)
