"""Preemption as clusters deliver it: real SIGTERM and SIGINT, sent from outside to real training
processes in the middle of a step, under every way of starting them.

Each program trains on 2 gloo processes with a sleep in its loss (so a signal lands mid-step),
saves every 4 steps, and is signalled once its periodic checkpoint at step 4 exists. Whatever
the pattern (the launcher, one rank, every process, copies of the signal, a Ctrl-C), every rank
stops at one step past that checkpoint after saving there, the job exits 143 and is never
restarted, and the message that says where it saved is printed once.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gpukit.launch.ports import free_port
from gpukit.lifecycle.preemption import SECOND_SIGNAL_AFTER_S
from tests import warm_gpukit

# Signals, grace periods and hang timeouts: one at a time under `make test`.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("timing")]

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEPS = 400  # far more than a test waits for: every run here ends by its signal
PERIODIC = 4  # --save-every

# The workload of `gpukit train`: its loss sleeps, and each rank writes its process id. Where
# a file "hold" exists, each rank's step HOLD waits in its loss until a file "go" exists.
HOLD = PERIODIC + 2
WORKLOAD = """
import os, time, torch
from torch import nn
from torch.utils.data import TensorDataset

def make():
    with open(f"pid-{os.environ.get('RANK', '0')}", "w") as f:
        f.write(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    steps = 0
    def loss(out, target):
        nonlocal steps
        steps += 1
        time.sleep(0.05)
        if steps == HOLD and os.path.exists("hold"):
            for _ in range(6000):
                if os.path.exists("go"):
                    break
                time.sleep(0.01)
        return nn.functional.mse_loss(out, target)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)), data, loss
""".replace("HOLD", str(HOLD))

# A program written like the PyTorch DDP tutorial, ported to gpukit: torchrun or
# `gpukit launch` start it as it is; `launch` as its third argument starts it with rt.launch.
# Once a file "slow" exists, each rank's next step takes a minute, which it says by a file
# "slowed-RANK" as it begins.
PROGRAM = """
import os, sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import gpukit as gk

def main(rt, steps):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    model, opt, loader = rt.setup(model, opt, DataLoader(data, batch_size=8, shuffle=True))
    with open(f"pid-{rt.rank}", "w") as f:
        f.write(str(os.getpid()))
    print(f"rank {rt.rank} started", flush=True)
    while rt.global_step < steps:
        for x, y in loader:
            if os.path.exists("slow"):
                open(f"slowed-{rt.rank}", "w").close()
                time.sleep(60)
            time.sleep(0.05)
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(opt)
            if rt.global_step >= steps:
                break

if __name__ == "__main__":
    launch = sys.argv[1:] == ["launch"]
    if launch:
        with open("pid-parent", "w") as f:
            f.write(str(os.getpid()))
    rt = gk.Runtime(devices=2 if launch else "auto", checkpoints="ck", save_every=PERIODIC, seed=0)
    if launch:
        rt.launch(main, STEPS)
    else:
        main(rt, STEPS)
        rt.teardown()
""".replace("PERIODIC", str(PERIODIC)).replace("STEPS", str(STEPS))


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPUKIT_JOB_DIR", "GPUKIT_FAULT"):
        env.pop(name, None)
    return env


def _warm(command: list[str]) -> list[str]:
    """``python SCRIPT ...`` forked by the warm-start server where tests have one
    (tests/conftest.py), as ``python -m gpukit`` commands are; the script's process is then
    not the one the test started, so it says its process id."""
    server = os.environ.get("GPUKIT_WARM_START")
    return warm_gpukit.script_command(command, server) if server else command


def _start(command: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(*paths: Path, job: subprocess.Popen[str], timeout: float = 180) -> None:
    """Until one of ``paths`` exists; the job ending first, or a job stuck for ``timeout``
    seconds (a hang guard, far beyond any healthy wait), fails the test with its output."""
    names = " or ".join(path.name for path in paths)
    deadline = time.monotonic() + timeout
    while not any(path.exists() for path in paths):
        if job.poll() is not None:
            pytest.fail(f"the job ended before {names} existed:\n{job.communicate()[0]}")
        if time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"no {names} after {timeout} s:\n{job.communicate()[0]}")
        time.sleep(0.1)


def _wait_for_slowed(folder: Path, job: subprocess.Popen[str]) -> None:
    """Until a rank is in its minute-long step. One is enough, and waiting for both could
    take the minute: a rank that looked for "slow" just before it existed goes on into its
    step's collective, where it waits for the sleeping one without ever seeing the file."""
    _wait_for(folder / "slowed-0", folder / "slowed-1", job=job)


def _pid(folder: Path, rank: int) -> int:
    return int((folder / f"pid-{rank}").read_text())


def _send(pids: list[int], sig: int) -> None:
    for pid in pids:
        os.kill(pid, sig)


def _stopped(job: subprocess.Popen[str], checkpoints: Path) -> tuple[str, int]:
    """The job's output and the step it saved at, once it ended on its own with 143 after one
    save past the periodic checkpoint it was signalled after."""
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 143, output
    saved = (checkpoints / "latest").read_text().strip()
    step = int(saved.removeprefix("step-"))
    assert step > PERIODIC, output  # the stop's own save, past the periodic one
    said = re.findall(r"stopped after step (\d+) on every rank and saved", output)
    assert said == [str(step)], output  # said once, naming the step it saved
    assert "restart" not in output, output  # a stop on request is never restarted
    return output, step


# -- gpukit train: the launcher, one rank, every process, copies, Ctrl-C ----------------------

Pattern = Callable[[subprocess.Popen[str], Path], None]


def _launcher(job: subprocess.Popen[str], folder: Path) -> None:
    job.send_signal(signal.SIGTERM)


def _one_rank(job: subprocess.Popen[str], folder: Path) -> None:
    _send([_pid(folder, 1)], signal.SIGTERM)


def _every_process_twice(job: subprocess.Popen[str], folder: Path) -> None:
    # scancel and Kubernetes signal every process; here the launcher too, then all again.
    everyone = [_pid(folder, 1), job.pid, _pid(folder, 0)]
    _send(everyone, signal.SIGTERM)
    _send(everyone, signal.SIGTERM)


def _ctrl_c(job: subprocess.Popen[str], folder: Path) -> None:
    job.send_signal(signal.SIGINT)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pattern", [_launcher, _one_rank, _every_process_twice, _ctrl_c], ids=lambda p: p.__name__
)
def test_gpukit_train_stops_once_saved_and_exits_143(tmp_path: Path, pattern: Pattern) -> None:
    (tmp_path / "slowload.py").write_text(WORKLOAD)
    job = _start(
        [
            sys.executable,
            "-m",
            "gpukit",
            "train",
            "--workload",
            "slowload:make",
            "--devices",
            "2",
            "--batch-size",
            "16",
            "--max-steps",
            str(STEPS),
            "--out",
            "run",
            "--save-every",
            str(PERIODIC),
            "--max-restarts",
            "2",
            "--progress-every",
            "0",
        ],
        tmp_path,
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    _wait_for(checkpoints / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    pattern(job, tmp_path)
    output, _ = _stopped(job, checkpoints)
    assert output.count("gpukit train: stopped on request (exit 143)") == 1, output
    # The cause is the signal sent: the launcher passes a Ctrl-C on as SIGTERM, yet says SIGINT.
    cause = {_one_rank: "SIGTERM received by rank 1", _ctrl_c: "SIGINT received by the launcher"}
    assert f"(exit 143): {cause.get(pattern, 'SIGTERM received')}" in output, output


@pytest.mark.slow
def test_a_preempted_run_resumed_ends_bitwise_equal_to_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    steps = 3 * PERIODIC  # past the step the cut run stops at (HOLD + 1 at most)
    train = [
        sys.executable,
        "-m",
        "gpukit",
        "train",
        "--workload",
        "slowload:make",
        "--devices",
        "2",
        "--batch-size",
        "16",
        "--max-steps",
        str(steps),
        "--save-every",
        str(PERIODIC),
        "--progress-every",
        "0",
        "--out",
        "run",
    ]
    # The uninterrupted run and the cut one run side by side, each in a folder of its own.
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for folder in (whole, cut):
        folder.mkdir()
        (folder / "slowload.py").write_text(WORKLOAD)
    reference = _start(train, whole)
    try:
        _cut_and_resume(train, cut, steps)
        assert reference.wait(timeout=300) == 0, reference.communicate()[0]
    finally:
        if reference.poll() is None:
            reference.kill()

    def weights(folder: Path) -> dict[str, object]:
        step = f"step-{steps:08d}"
        return load_file(str(folder / "run" / "checkpoints" / step / "model.safetensors"))

    a, b = weights(whole), weights(cut)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # type: ignore[attr-defined]


def _cut_and_resume(train: list[str], cut: Path, steps: int) -> None:
    """Run ``train`` in ``cut``, preempted past its first periodic checkpoint, then resumed."""
    # The cut run's ranks wait in step HOLD until the test has signalled them: it stops at a
    # step before the last however late the signal comes.
    (cut / "hold").touch()
    job = _start(train, cut)
    _wait_for(cut / "run" / "checkpoints" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    _send([_pid(cut, 0), _pid(cut, 1)], signal.SIGTERM)
    (cut / "go").touch()
    _, step = _stopped(job, cut / "run" / "checkpoints")
    assert step < steps
    (cut / "hold").unlink()
    again = subprocess.run([*train, "--resume"], cwd=cut, env=_env(), timeout=300)
    assert again.returncode == 0


# -- the same program under gpukit launch, torchrun and rt.launch -------------------------------


@pytest.fixture
def program(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROGRAM))
    return script


@pytest.mark.slow
def test_gpukit_launch_one_rank_signalled(tmp_path: Path, program: Path) -> None:
    job = _start(
        [
            sys.executable,
            "-m",
            "gpukit",
            "launch",
            "--nproc",
            "2",
            "--max-restarts",
            "1",
            str(program),
        ],
        tmp_path,
    )
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    _send([_pid(tmp_path, 1)], signal.SIGTERM)
    output, _ = _stopped(job, tmp_path / "ck")
    assert output.count("gpukit launch: stopped on request (exit 143)") == 1, output


@pytest.mark.slow
def test_ranks_that_cannot_save_within_the_grace_period_are_killed_and_it_says_so(
    tmp_path: Path, program: Path
) -> None:
    job = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", str(program)],
        cwd=tmp_path,
        env={**_env(), "GPUKIT_STOP_GRACE": "1"},  # ranks in a minute-long step never save
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    (tmp_path / "slow").touch()  # the next step takes a minute: no save can come in time
    _wait_for_slowed(tmp_path, job)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 143, output
    assert re.search(
        r"gpukit launch: stopped on request \(exit 143\); the ranks did not save and exit within "
        r"the grace period, so they were killed \(the newest checkpoint is step \d+\): give them "
        r"longer with GPUKIT_STOP_GRACE=SECONDS",
        output,
    ), output


@pytest.mark.slow
def test_a_second_ctrl_c_to_the_launcher_stops_the_ranks_at_once(
    tmp_path: Path, program: Path
) -> None:
    job = _start([sys.executable, "-m", "gpukit", "launch", "--nproc", "2", str(program)], tmp_path)
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    (tmp_path / "slow").touch()  # the step under way outlasts the test: only a kill ends it
    _wait_for_slowed(tmp_path, job)
    job.send_signal(signal.SIGINT)
    time.sleep(SECOND_SIGNAL_AFTER_S + 0.5)  # later than any copy of the first would come
    job.send_signal(signal.SIGINT)
    output = job.communicate(timeout=30)[0]
    assert job.returncode == 130, output
    assert "gpukit launch: stopped at once by a second Ctrl-C, without saving" in output, output


@pytest.mark.slow
@pytest.mark.parametrize("everyone", [False, True], ids=["one-rank", "every-process"])
def test_torchrun_ranks_save_and_the_agent_does_not_restart_them(
    tmp_path: Path, program: Path, everyone: bool
) -> None:
    # A port of its own: torchrun's default (29500) is shared by every test run on the machine.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port())]
    job = _start(
        [
            *torchrun,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--monitor-interval",
            "0.1",
            str(program),
        ],
        tmp_path,
    )
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    ranks = [_pid(tmp_path, 0), _pid(tmp_path, 1)]
    _send([job.pid, *ranks] if everyone else ranks[1:], signal.SIGTERM)
    output = job.communicate(timeout=120)[0]
    # The agent was told to stop (by the scheduler, or by the ranks once they saved), rather
    # than left to count their exit 143 as a failure to restart; torchrun then ends with its
    # own SignalException (exit 1).
    assert "Received 15 death signal" in output, output
    assert job.returncode != 0, output
    saved = int((tmp_path / "ck" / "latest").read_text().strip().removeprefix("step-"))
    assert saved > PERIODIC, output
    said = re.findall(r"stopped after step (\d+) on every rank and saved", output)
    assert said == [str(saved)], output
    assert output.count("rank 0 started") == 1, output  # never started again


@pytest.mark.slow
@pytest.mark.parametrize("whom", ["parent", "one-rank"])
def test_rt_launch_raises_preempted_in_the_parent(tmp_path: Path, program: Path, whom: str) -> None:
    job = _start(_warm([sys.executable, str(program), "launch"]), tmp_path)
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    parent = int((tmp_path / "pid-parent").read_text())
    _send([parent if whom == "parent" else _pid(tmp_path, 1)], signal.SIGTERM)
    _stopped(job, tmp_path / "ck")


# One process whose loader has worker processes, signalled as Slurm does: every process of the
# job, its DataLoader workers included.
WORKERS = """
import time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import gpukit as gk

class Slow(TensorDataset):
    def __getitem__(self, i):
        time.sleep(0.01)
        return super().__getitem__(i)

if __name__ == "__main__":
    rt = gk.Runtime(devices="cpu", checkpoints="ck", seed=0, save_every=PERIODIC)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Slow(torch.randn(4096, 8), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2)
    model, opt, loader = rt.setup(model, opt, loader)
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
""".replace("PERIODIC", str(PERIODIC))


@pytest.mark.slow
def test_a_signal_to_the_whole_process_group_spares_the_loaders_workers(tmp_path: Path) -> None:
    (tmp_path / "workers.py").write_text(WORKERS)
    job = subprocess.Popen(
        [sys.executable, "workers.py"],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a scheduler's job step
    )
    _wait_for(tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json", job=job)
    os.killpg(job.pid, signal.SIGTERM)
    output, _ = _stopped(job, tmp_path / "ck")
    assert "exited unexpectedly" not in output, output
