"""Ranks forked by the warm-start server behave as ranks started cold: the environment,
arguments and folder they get, their exit codes, their death with the launcher, restarts."""

from __future__ import annotations

import gzip
import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpukit
from gpukit.errors import LaunchError
from gpukit.launch import RUNNER, run_job, warm_client
from gpukit.launch.workers import Worker, start_worker

pytestmark = pytest.mark.processes

SRC = str(Path(gpukit.__file__).resolve().parents[1])
ROOT = Path(__file__).resolve().parents[2]

REPORT = """
import json, os, sys, tempfile
print("to stdout", flush=True)
print("to stderr", file=sys.stderr, flush=True)
with open(os.environ["OUT"], "w") as file:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(),
               "path0": sys.path[0], "main": __name__, "tmp": tempfile.gettempdir()}, file)
"""


# What this module's own server imports besides torch and gpukit.
PRELOADED = ("colorsys", "tests.launch.released_probe")


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A warm-start server of this module's, started with the modules of PRELOADED."""
    path = str(tmp_path_factory.mktemp("warm") / "socket")
    started = warm_client.start_server(path, preload=PRELOADED)
    yield path
    started.terminate()
    started.wait(timeout=30)


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> str:
    """The session's warm-start server, or this module's own (a session run cold), which the
    preload test then shares rather than starting one more (torch's import, seconds)."""
    path = os.environ.get("GPUKIT_WARM_START")
    return path if path else str(request.getfixturevalue("own_server"))


def start(
    monkeypatch: pytest.MonkeyPatch, socket: str | None, args: list[str], env: dict[str, str]
) -> Worker:
    """``RUNNER args`` as rank 0, from the warm-start server at ``socket`` (None: cold)."""
    if socket is None:
        monkeypatch.delenv("GPUKIT_WARM_START", raising=False)
    else:
        monkeypatch.setenv("GPUKIT_WARM_START", socket)
    worker = start_worker(0, [sys.executable, str(RUNNER), *args], env, queue.SimpleQueue())
    assert worker.wait(120), "the rank did not end"
    return worker


@pytest.mark.parametrize("lang", ["C.UTF-8", None])  # None: Python coerces the C locale
def test_a_warm_rank_gets_exactly_what_a_cold_one_gets(
    server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    lang: str | None,
) -> None:
    (tmp_path / "report.py").write_text(REPORT)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    given = {"PATH": os.environ["PATH"], "PYTHONPATH": SRC, "TMPDIR": str(tmp_path)}
    given.update({"LANG": lang} if lang else {})
    seen = {}
    for how, socket in (("cold", None), ("warm", server)):
        worker = start(
            monkeypatch, socket, ["../report.py", "--flag", "a b"], {**given, "OUT": how}
        )
        assert worker.returncode == 0
        seen[how] = json.loads((work / how).read_text())
        seen[how]["env"].pop("OUT")
        if how == "warm":  # the one addition: who asked for the rank, its parent if cold
            assert seen[how]["env"].pop("GPUKIT_WARM_PARENT") == str(os.getpid())
        out, err = capfd.readouterr()
        assert (out, err) == ("to stdout\n", "to stderr\n"), how
    assert seen["warm"] == seen["cold"]
    assert seen["warm"]["argv"] == ["../report.py", "--flag", "a b"]
    assert seen["warm"]["cwd"] == str(work)
    assert seen["warm"]["path0"] == str(tmp_path)
    assert seen["warm"]["main"] == "__main__"
    assert seen["warm"]["tmp"] == str(tmp_path)  # not the server's, which Python kept
    if lang is not None:
        assert seen["warm"]["env"] == given


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit(259)", 3),
        ("import sys; sys.exit('stopped')", 1),
        ("raise KeyboardInterrupt", -signal.SIGINT),
        ("raise ValueError('no')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL),
        ("print('done')", 0),
    ],
)
def test_exit_codes_and_deaths_by_signal_read_as_popen_reports_them(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, code: int
) -> None:
    (tmp_path / "end.py").write_text(body)
    env = {"PYTHONPATH": SRC}
    assert start(monkeypatch, server, [str(tmp_path / "end.py")], env).returncode == code
    assert start(monkeypatch, None, [str(tmp_path / "end.py")], env).returncode == code


COLLECTS = """
import gc, sys
import torch

class Cycle:
    pass

a, b = Cycle(), Cycle()
a.other, b.other = b, a
del a, b
found = gc.collect()  # the rank's own garbage is collected as in a cold interpreter
sys.exit(0 if found >= 2 and (gc.get_freeze_count() > 0) == (sys.argv[1] == "warm") else 1)
"""


def test_a_warm_rank_collects_its_own_garbage_and_not_the_servers_imports(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's imports are frozen: the rank's collections (and the one at its exit) leave
    # the pages the fork shares alone, so that a warm rank exits sooner than a cold one.
    (tmp_path / "collects.py").write_text(COLLECTS)
    env = {"PYTHONPATH": SRC}
    for how, socket in (("warm", server), ("cold", None)):
        ran = start(monkeypatch, socket, [str(tmp_path / "collects.py"), how], env)
        assert ran.returncode == 0, how


def test_a_rank_is_waited_for_without_the_start_timeout(server: str, tmp_path: Path) -> None:
    # The start's reply timeout must not limit the rank's life: a connection left with it
    # would make poll() and wait() raise TimeoutError on any rank running past it.
    (tmp_path / "short.py").write_text("pass")
    rank = warm_client.start_rank(server, [str(tmp_path / "short.py")], {"PYTHONPATH": SRC})
    assert rank._conn.gettimeout() is None
    assert rank.wait() == 0


EXITS = """
import atexit, ctypes, gzip, os, sys, threading, time
import gpukit
import tests.launch.released_probe

left = open(os.path.join(sys.argv[1], "left.txt"), "w")
left.write("left open in a global")
held = gzip.open(os.path.join(sys.argv[1], "held.gz"), "wt")
held.write("held only through gpukit")
gpukit._held_by_the_test = held
del held


class Finalized:
    def __init__(self, what):
        self.what = what

    def __del__(self):
        print(self.what, flush=True)


finalized = Finalized("a global's finalizer ran")
gpukit._finalized_by_the_test = Finalized("an object only gpukit holds was released")
atexit.register(print, "atexit ran", flush=True)


def late():
    time.sleep(0.2)
    print("a thread ended", flush=True)


threading.Thread(target=late).start()
ctypes.CDLL(None).printf(b"C stdio flushed\\n")
print("main ended", flush=True)
"""


def test_a_warm_rank_ends_as_a_cold_one_without_releasing_the_servers_modules(
    own_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    # Releasing the server's modules would copy every page the fork shares (a third of a
    # second of CPU per rank), so a warm rank skips only that: its threads, atexit handlers,
    # its objects' finalizers (one held only by gpukit's module too), the files it left open
    # and C's stdio buffers end as in a cold interpreter.
    (tmp_path / "exits.py").write_text(EXITS)
    env = {"PYTHONPATH": os.pathsep.join([SRC, str(ROOT)]), "RELEASED_PROBE": "1"}
    printed = {}
    for how, socket in (("warm", own_server), ("cold", None)):
        out = tmp_path / how
        out.mkdir()
        ran = start(monkeypatch, socket, [str(tmp_path / "exits.py"), str(out)], env)
        assert ran.returncode == 0, how
        printed[how] = capfd.readouterr().out.splitlines()
        assert (out / "left.txt").read_text() == "left open in a global", how
        assert gzip.decompress((out / "held.gz").read_bytes()) == b"held only through gpukit", how
    released = "a module the server imported was released"
    assert released in printed["cold"] and released not in printed["warm"]
    # Where C's buffered line lands depends on how the server's C stdio was buffered.
    python_only = {"C stdio flushed", released}
    assert "C stdio flushed" in printed["warm"]
    assert [line for line in printed["warm"] if line not in python_only] == [
        "main ended",
        "a thread ended",
        "atexit ran",
        "a global's finalizer ran",
        "an object only gpukit holds was released",
    ]
    assert [line for line in printed["cold"] if line not in python_only] == [
        line for line in printed["warm"] if line not in python_only
    ]


# A launcher that starts one warm rank, which starts a process of its own (in its group).
LAUNCHER = """
import os, queue, sys, time
from gpukit.launch import RUNNER
from gpukit.launch.workers import start_worker
start_worker(0, [sys.executable, str(RUNNER), sys.argv[1], sys.argv[2]], dict(os.environ),
             queue.SimpleQueue())
time.sleep(600)
"""
RANK = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "600"])
with open(sys.argv[1] + ".tmp", "w") as file:
    file.write(f"{os.getpid()} {child.pid} {os.getppid()}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_ranks_group_dies_when_its_launcher_is_sigkilled(server: str, tmp_path: Path) -> None:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "rank.py").write_text(RANK)
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": SRC, "GPUKIT_WARM_START": server}
    launcher = subprocess.Popen(
        [sys.executable, "launcher.py", "rank.py", str(pids)], cwd=tmp_path, env=env
    )
    deadline = time.monotonic() + 120
    while not pids.exists():
        assert launcher.poll() is None and time.monotonic() < deadline, "the rank did not start"
        time.sleep(0.05)
    rank, child, parent = map(int, pids.read_text().split())
    assert parent != launcher.pid  # forked by the server indeed
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while (_alive(rank) or _alive(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in (rank, child) if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left


TRAIN = """
import os, sys
import torch, torch.distributed as dist
from gpukit.launch.heartbeat import Heartbeat

beats = Heartbeat.from_env()
beats.beat("start", 0)
attempt = int(os.environ["GPUKIT_ATTEMPT"])
dist.init_process_group("gloo")
for step in range(3):
    beats.beat("forward", step)
    total = torch.ones(1)
    dist.all_reduce(total)
    beats.beat("optimizer", step)
    if step == 1 and attempt == 0 and dist.get_rank() == 1:
        raise ValueError("bad batch")
with open(os.path.join(sys.argv[1], f"done-{dist.get_rank()}-{attempt}"), "w") as file:
    file.write(f"{total.item():g} {os.getppid()}")
dist.destroy_process_group()
"""


def test_a_two_rank_job_restarts_and_succeeds_under_the_server(
    server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_WARM_START", server)
    monkeypatch.setenv("PYTHONPATH", SRC)
    (tmp_path / "train.py").write_text(TRAIN)
    command = [sys.executable, str(RUNNER), str(tmp_path / "train.py"), str(tmp_path)]
    code = run_job(command, 2, max_restarts=1, job_dir=tmp_path / "job")
    assert code == 0
    done = sorted(p.name for p in tmp_path.glob("done-*"))
    assert done == ["done-0-1", "done-1-1"]
    for name in done:
        total, parent = (tmp_path / name).read_text().split()
        assert total == "2" and int(parent) != os.getpid()  # forked by the server


def test_a_socket_nobody_serves_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "nobody")
    monkeypatch.setenv("GPUKIT_WARM_START", path)
    with pytest.raises(LaunchError, match=r"GPUKIT_WARM_START=.*nobody: no warm-start server"):
        start_worker(0, [sys.executable, str(RUNNER), "x.py"], {}, queue.SimpleQueue())


def serve(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m gpukit.launch.warm args``, run to its end (a server that cannot start)."""
    return subprocess.run(
        [sys.executable, "-m", "gpukit.launch.warm", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": SRC},
    )


def test_a_second_server_on_a_served_socket_is_refused(server: str) -> None:
    done = serve(server)
    assert done.returncode == 1
    assert f"{server} is served already" in done.stderr
    assert os.path.exists(server)  # the first server's socket stays


def test_modules_named_after_the_socket_are_imported_before_the_first_fork(
    own_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "has.py").write_text("import sys; sys.exit(0 if 'colorsys' in sys.modules else 7)")
    env = {"PYTHONPATH": SRC}
    assert start(monkeypatch, own_server, [str(tmp_path / "has.py")], env).returncode == 0
    assert start(monkeypatch, None, [str(tmp_path / "has.py")], env).returncode == 7


def test_a_module_the_server_cannot_preload_stops_it_naming_the_module(tmp_path: Path) -> None:
    done = serve(str(tmp_path / "socket"), "no_such_module")
    assert done.returncode == 1
    assert "cannot preload no_such_module: ModuleNotFoundError" in done.stderr
    assert not (tmp_path / "socket").exists()
