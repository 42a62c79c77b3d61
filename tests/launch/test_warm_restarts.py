"""A job that may restart keeps a warm-start server of its own: attempt 0 starts cold, every
restart is forked from the server, which dies with the launcher; what a fork cannot honour, a
server that died, or the opt-out make the restarts cold, said once; a restart resumes bit for
bit as an uninterrupted run does. Real launchers, ranks and signals; the user's server is unset."""

from __future__ import annotations

import errno
import io
import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import gpukit
import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.launch import RUNNER, run_job, warm_client
from gpukit.launch.ports import free_port
from gpukit.launch.starters import CommandStarter
from gpukit.launch.warm_restarts import SOCKET_NAME, UNHONOURED, WarmRestarts, unhonoured

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="reads /proc, PR_SET_PDEATHSIG is Linux's"
    ),
]

SRC = str(Path(gpukit.__file__).resolve().parents[1])

# A rank that notes its pid, its parent and its parent's command line, then (rank 1, on the
# attempts named in FAIL_ON) fails after a step, or (with HOLD) waits to be killed.
RANK = """
import json, os, signal, sys, time
import torch, torch.distributed as dist
from gpukit.launch.heartbeat import Heartbeat

out = sys.argv[1]
attempt = int(os.environ["GPUKIT_ATTEMPT"])
rank = int(os.environ["RANK"])
with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
    parent = file.read().replace(b"\\0", b" ").decode()
if os.environ.get("KILL_SERVER") and attempt == 0 and rank == 1:
    sock = os.path.join(os.environ["GPUKIT_JOB_DIR"], "warm.sock")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                line = file.read().split(b"\\0")
        except OSError:
            continue
        if b"gpukit.launch.warm" in line and sock.encode() in line:
            os.kill(int(pid), signal.SIGKILL)
note = {"pid": os.getpid(), "ppid": os.getppid(), "parent": parent}
path = os.path.join(out, f"rank-{rank}-{attempt}")
with open(path + ".tmp", "w") as file:
    json.dump(note, file)
os.rename(path + ".tmp", path)
beats = Heartbeat.from_env()
beats.beat("start", 0)
dist.init_process_group("gloo")
for step in range(2):
    beats.beat("forward", step)
    dist.all_reduce(torch.ones(1))
    beats.beat("optimizer", step)
if os.environ.get("HOLD") and attempt == 1:
    time.sleep(600)
if str(attempt) in os.environ.get("FAIL_ON", "0").split(",") and rank == 1:
    raise ValueError("bad batch")
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The rank script in ``tmp_path``, with no warm-start server of the user's."""
    monkeypatch.delenv("GPUKIT_WARM_START", raising=False)
    monkeypatch.delenv("GPUKIT_WARM_RESTART", raising=False)
    monkeypatch.setenv("PYTHONPATH", SRC)
    (tmp_path / "rank.py").write_text(RANK)
    return tmp_path


def _command(folder: Path) -> list[str]:
    return [sys.executable, str(RUNNER), str(folder / "rank.py"), str(folder)]


def _notes(folder: Path, attempt: int) -> list[dict[str, object]]:
    return [json.loads((folder / f"rank-{r}-{attempt}").read_text()) for r in (0, 1)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is gone
    except FileNotFoundError:
        return False


def _run(
    folder: Path, restarts: int, env: dict[str, str] | None = None, hang_timeout: float = 300
) -> tuple[int, str]:
    out = io.StringIO()
    code = run_job(
        _command(folder),
        2,
        max_restarts=restarts,
        env=env,
        out=out,
        job_dir=folder / "job",
        hang_timeout=hang_timeout,
    )
    return code, out.getvalue()


def test_restarts_are_forked_from_the_jobs_own_server_and_attempt_0_starts_cold(
    job: Path,
) -> None:
    code, output = _run(job, 1)
    assert code == 0, output
    assert [n["ppid"] for n in _notes(job, 0)] == [os.getpid()] * 2  # cold, as before
    restarted = _notes(job, 1)
    server = restarted[0]["ppid"]
    assert server != os.getpid() and restarted[1]["ppid"] == server
    assert "gpukit.launch.warm" in str(restarted[0]["parent"])
    assert str(job / "job" / SOCKET_NAME) in str(restarted[0]["parent"])  # the job's folder
    assert isinstance(server, int) and not _alive(server)  # ended with the job
    assert not (job / "job" / SOCKET_NAME).exists()
    assert "fresh interpreter" not in output


def test_with_the_opt_out_every_attempt_starts_cold(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's starter is the cold one, with nothing to say (the user asked for it); a cold
    restart's ranks are the launcher's children (the other cold tests run such a job)."""
    monkeypatch.setenv("GPUKIT_WARM_RESTART", "0")
    ranks, note = WarmRestarts.for_job(_command(job), {}, job, max_restarts=3)
    assert type(ranks) is CommandStarter and note is None


def test_a_wrong_opt_out_value_is_refused_naming_what_is_allowed(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUKIT_WARM_RESTART", "off")
    with pytest.raises(ConfigError, match=r"GPUKIT_WARM_RESTART='off': give 1 .* or 0"):
        _run(job, 1)
    assert not list(job.glob("rank-*"))


def test_a_variable_a_fork_cannot_honour_makes_restarts_cold_said_once(job: Path) -> None:
    assert unhonoured({"PYTHONDUMPREFS": "1"}) == ["PYTHONDUMPREFS"]
    assert "PYTHONHASHSEED" not in UNHONOURED  # the job's own server is started with it
    code, output = _run(job, 2, env={"PYTHONDUMPREFS": "1", "FAIL_ON": "0,1"})
    assert code == 0, output
    assert output.count("PYTHONDUMPREFS set") == 1, output
    assert "restart 2/2" in output, output
    for attempt in (1, 2):
        assert [n["ppid"] for n in _notes(job, attempt)] == [os.getpid()] * 2


def test_a_server_that_died_makes_the_restart_cold_said_once(job: Path) -> None:
    code, output = _run(job, 1, env={"KILL_SERVER": "1"})
    assert code == 0, output
    assert output.count("restarts start every rank as a fresh interpreter") == 1, output
    assert [n["ppid"] for n in _notes(job, 1)] == [os.getpid()] * 2


def test_a_server_that_cannot_be_spawned_leaves_the_job_cold_said_once(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fork refused (EAGAIN at the process limit): the job runs all the same, its restarts
    cold, and the launcher is told why once. The ranks here are a one-line interpreter: what
    is checked is who starts them."""

    def no_process(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))  # fork's answer at the limit

    monkeypatch.setattr(warm_client, "spawn_server", no_process)
    ranks, note = WarmRestarts.for_job(_command(job), {}, job, max_restarts=1)
    assert isinstance(ranks, WarmRestarts) and note is None and ranks.server is None
    told = ranks.told()
    assert told is not None and told.startswith("the job's warm-start server did not start")
    assert told.endswith("restarts start every rank as a fresh interpreter")
    assert ranks.told() is None  # said once
    note = "import os, sys; open(sys.argv[1], 'w').write(str(os.getppid()))"
    ranks.cold = CommandStarter([sys.executable, "-c", note, str(job / "parent")])
    events: queue.SimpleQueue[int] = queue.SimpleQueue()
    worker = ranks.start(0, {**os.environ, "GPUKIT_ATTEMPT": "1"}, events)
    assert worker.wait(timeout=60) and worker.returncode == 0
    assert (job / "parent").read_text() == str(os.getpid())  # a restart, started cold
    ranks.close()


LAUNCHER = """
import sys
from gpukit.launch import RUNNER, run_job
sys.exit(run_job([sys.executable, str(RUNNER), "rank.py", "."], 2, max_restarts=1, job_dir="job"))
"""


def test_a_sigkilled_launcher_takes_its_server_and_every_rank_with_it(job: Path) -> None:
    (job / "launcher.py").write_text(LAUNCHER)
    env = {**os.environ, "HOLD": "1"}
    launcher = subprocess.Popen([sys.executable, "launcher.py"], cwd=job, env=env)
    deadline = time.monotonic() + 240
    while not all((job / f"rank-{r}-1").exists() for r in (0, 1)):
        assert launcher.poll() is None and time.monotonic() < deadline, "no restart came"
        time.sleep(0.05)
    restarted = _notes(job, 1)
    server = restarted[0]["ppid"]
    assert isinstance(server, int) and server != launcher.pid  # forked by the job's server
    pids = [server, *(int(str(n["pid"])) for n in restarted)]
    time.sleep(0.5)  # the ranks sit in their wait, past the start-up
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:  # leave nothing behind, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert not left


def test_a_warm_rank_that_hangs_is_caught_by_the_hang_watch(job: Path) -> None:
    code, output = _run(job, 1, env={"HOLD": "1"}, hang_timeout=5)
    assert code == 1, output
    assert "rank 0 hung" in output or "rank 1 hung" in output, output
    assert os.getpid() not in {n["ppid"] for n in _notes(job, 1)}  # the hung ranks were warm


def test_sigterm_to_the_launcher_reaches_warm_ranks_and_exits_143(job: Path) -> None:
    (job / "launcher.py").write_text(LAUNCHER)
    env = {**os.environ, "HOLD": "1"}
    launcher = subprocess.Popen([sys.executable, "launcher.py"], cwd=job, env=env)
    deadline = time.monotonic() + 240
    while not all((job / f"rank-{r}-1").exists() for r in (0, 1)):
        assert launcher.poll() is None and time.monotonic() < deadline, "no restart came"
        time.sleep(0.05)
    restarted = _notes(job, 1)
    assert restarted[0]["ppid"] != launcher.pid  # forked by the job's server
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=120) == 143  # the ranks ended by SIGTERM: stopped on request
    assert not any(_alive(int(str(n["pid"]))) for n in restarted)
    assert not _alive(int(str(restarted[0]["ppid"])))


def test_each_node_restarts_its_ranks_from_a_server_of_its_own(job: Path) -> None:
    port = str(free_port())
    launch = [sys.executable, "-m", "gpukit", "launch", "--nproc", "1", "--nnodes", "2"]
    where = ["--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(node), *where, "--max-restarts", "1", "rank.py", "."],
            executable=sys.executable,  # cold: the launcher, not a fork of the tests' server
            cwd=job,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=400)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    restarted = _notes(job, 1)  # global rank r runs on node r
    assert restarted[0]["ppid"] != restarted[1]["ppid"]
    for node, note in zip(nodes, restarted, strict=True):
        assert "gpukit.launch.warm" in str(note["parent"])
        assert f"gpukit-job-{node.pid}-" in str(note["parent"])  # that node's job folder


# `gpukit train` through a script that notes each rank's parent first.
TRAIN = """
import os, runpy, sys
name = f"{os.environ['RANK']}-{os.environ['GPUKIT_ATTEMPT']}"
with open(os.path.join(os.environ["NOTES"], name), "w") as file:
    file.write(str(os.getppid()))
runpy.run_module("gpukit", run_name="__main__", alter_sys=True)
"""
STEPS = 8


def _train(folder: Path, warm: bool | None, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """``gpukit train`` on 2 ranks whose rank 1 fails at step 5, restarted warm or cold; with
    ``warm=None``, the same run uninterrupted."""
    folder.mkdir()
    (folder / "notes").mkdir()
    (folder / "train.py").write_text(TRAIN)
    args = ["train", "--workload", "mlp", "--strategy", "ddp", "--max-steps", str(STEPS)]
    args += ["--save-every", "2", "--out", str(folder / "run")]
    env = {"NOTES": str(folder / "notes")}
    if warm is not None:
        env["GPUKIT_FAULT"] = "raise:1:5"
        monkeypatch.setenv("GPUKIT_WARM_RESTART", "1" if warm else "0")
    out = io.StringIO()
    command = [sys.executable, str(RUNNER), str(folder / "train.py"), *args]
    code = run_job(command, 2, max_restarts=1, env=env, out=out, job_dir=folder / "job")
    assert code == 0, out.getvalue()
    if warm is not None:
        assert "restart 1/1" in out.getvalue()
        parents = {(folder / "notes" / f"{r}-1").read_text() for r in (0, 1)}
        assert (parents == {str(os.getpid())}) is not warm  # the restart was warm, or cold
        # The job's events: the restart with its cause, then the end with its exit code.
        lines = (folder / "job" / "events.jsonl").read_text().splitlines()
        kinds = {e["kind"]: e for e in map(json.loads, lines)}
        assert (
            kinds["restart"]["cause"].startswith("rank 1 raised") and kinds["restart"]["rank"] == 1
        )
        assert kinds["ended"]["code"] == 0 and lines[-1] == json.dumps(kinds["ended"])
    checkpoints = folder / "run" / "checkpoints"
    newest = checkpoints / (checkpoints / "latest").read_text().strip()
    assert newest.name == f"step-{STEPS:08d}"
    return load_file(str(newest / "model.safetensors"))


def test_a_warm_restart_resumes_bit_for_bit_as_an_uninterrupted_run(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm, the restart ends where the run without a failure ends, bit for bit (a cold one
    does too: tests/checkpoint's interrupted runs)."""
    warm = _train(job / "warm", True, monkeypatch)
    whole = _train(job / "whole", None, monkeypatch)
    assert warm.keys() == whole.keys()
    assert all(warm[name].equal(whole[name]) for name in warm)  # type: ignore[attr-defined]


def _steps_then_fails(rt: gk.Runtime, folder: str) -> None:
    """Run by reference (``rt.launch``'s spawn): notes its parent; rank 1 fails on attempt 0."""
    attempt = os.environ["GPUKIT_ATTEMPT"]
    Path(folder, f"{attempt}-{rt.rank}").write_text(str(os.getppid()))
    net = nn.Linear(2, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        rt.backward(model(torch.ones(2, 2)).sum())
        rt.step(optimizer)
    if rt.rank == 1 and attempt == "0":
        raise ValueError("bad batch")


def test_rt_launch_restarts_its_ranks_from_the_jobs_own_server_too(job: Path) -> None:
    gk.Runtime(devices=2).launch(_steps_then_fails, str(job), max_restarts=1)
    assert {(job / f"0-{r}").read_text() for r in (0, 1)} == {str(os.getpid())}
    assert str(os.getpid()) not in {(job / f"1-{r}").read_text() for r in (0, 1)}
