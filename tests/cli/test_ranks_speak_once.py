"""A job of several ranks says each thing once: gpukit's warnings come from rank 0 alone, and
bad input is refused as one process refuses it (one line, exit 2), not once per rank."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gpukit.errors import warn_user

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Trains 2 steps and saves, resuming from the checkpoints in argv[1] when there are some.
RESUMING = """
import sys, torch, gpukit as gk
rt = gk.Runtime(seed=0, checkpoints=sys.argv[1], resume="auto")
model = torch.nn.Linear(2, 2)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(2):
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step(optimizer)
rt.save()
"""

# Everything gpukit says in a run: rt.print, a resume, a warning, the file form's save and load.
SAYS_EACH_ONCE = """
import collections, sys, torch, gpukit as gk
rt = gk.Runtime(seed=0, checkpoints="ckpt", resume="auto", accumulate=2)
rt.print("said by rt.print", rt.world_size)
model = torch.nn.Linear(2, 2)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range(4):
    rt.backward(model(torch.ones(1, 2)).sum())
    rt.step(optimizer)
rt.backward(model(torch.ones(1, 2)).sum())
rt.save()  # inside an accumulation window: a warning
rt.save("run.pt", {"model": model, "optimizer": optimizer})
rt.print("the file holds", sorted(rt.load("run.pt", {"model": model})))
"""

LOGS_A_STRING = """
import torch, gpukit as gk
rt = gk.Runtime()
model = rt.setup(torch.nn.Linear(2, 1))
loss = model(torch.ones(1, 2)).sum()
rt.log(loss="abc")
"""

WORKLOADS = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


def vector_loss():
    data = TensorDataset(torch.randn(64, 2), torch.randn(64, 1))
    return nn.Linear(2, 1), data, nn.MSELoss(reduction="none")
"""


def _gpukit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(cwd)])}
    return subprocess.run(
        [sys.executable, "-m", "gpukit", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.processes
def test_a_warning_of_a_launched_script_is_printed_once(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(RESUMING)
    first = _gpukit("launch", "--nproc", "2", "train.py", "ckpt", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "ckpt" / "latest").unlink()  # resuming falls back, with a warning
    again = _gpukit("launch", "--nproc", "2", "train.py", "ckpt", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("no 'latest' file in ckpt: resuming from step-00000002") == 1


@pytest.mark.processes
def test_every_line_of_a_two_rank_run_is_said_once(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SAYS_EACH_ONCE)
    first = _gpukit("launch", "--nproc", "2", "train.py", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = _gpukit("launch", "--nproc", "2", "train.py", cwd=tmp_path)  # resumes
    assert again.returncode == 0, again.stderr
    for done in (first, again):
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert len(lines) == len(set(lines)), lines  # no line twice
        assert done.stdout.count("said by rt.print 2") == 1
        assert done.stdout.count("the file holds ['optimizer']") == 1
    assert first.stderr.count("saving in the middle of an accumulation window") == 1
    assert again.stdout.count("gpukit: resumed from ckpt at step 2") == 1
    # Resumed at the first forward: said once, naming the program's line, not torch's.
    assert again.stderr.count("UserWarning: resumed at step 2 at the first forward") == 1
    assert "train.py:8: UserWarning: resumed at step 2" in again.stderr


@pytest.mark.processes
def test_a_warning_of_gpukit_train_on_two_ranks_is_printed_once(tmp_path: Path) -> None:
    train = ("train", "--workload", "mlp", "--devices", "2", "--out", "run")
    first = _gpukit(*train, "--max-steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "run" / "checkpoints" / "latest").unlink()
    again = _gpukit(*train, "--max-steps", "3", "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    output = again.stdout + again.stderr
    assert output.count("no 'latest' file in") == 1, output


@pytest.mark.processes
def test_bad_input_in_a_launched_script_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Every rank raises the same ConfigError: one line with the script's line, exit 2, and
    no restart (it would fail the same way)."""
    (tmp_path / "train.py").write_text(LOGS_A_STRING)
    done = _gpukit("launch", "--nproc", "2", "--max-restarts", "2", "train.py", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpukit launch: error: rt.log(loss=...) got 'abc', a str")
    assert line.endswith("(ConfigError at train.py:6)")


@pytest.mark.processes
def test_bad_input_on_one_rank_only_is_its_line(tmp_path: Path) -> None:
    """Only rank 1 is refused (no device for it): its message, once; rank 0 was stopped."""
    (tmp_path / "train.py").write_text("import gpukit as gk\nrt = gk.Runtime(devices=['cpu'])\n")
    done = _gpukit("launch", "--nproc", "2", "train.py", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpukit launch: error: local rank 1 has no device")
    # It names what works: the same script runs with either spelling.
    assert "devices='cpu' (every process on the CPU), or devices='cpu, cpu'" in line


FULL_DISK = """
import errno, torch, gpukit as gk
from gpukit.checkpoint import writer

def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")

writer.save_model = full  # the disk is full where rank 0 writes the weights
rt = gk.Runtime(devices="cpu, cpu", checkpoints="ck")
model = torch.nn.Linear(2, 1)
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
rt.backward(model(torch.ones(4, 2)).mean())
rt.step(opt)
rt.save()
"""


@pytest.mark.processes
def test_a_checkpoint_the_disk_refused_is_said_once_for_the_job(tmp_path: Path) -> None:
    """Rank 0 writes and fails, rank 1 writes nothing: every rank raises the agreed error, and
    the launcher says it once, naming no rank, exits 2 and does not restart."""
    (tmp_path / "train.py").write_text(FULL_DISK)
    done = _gpukit("launch", "--nproc", "2", "--max-restarts", "2", "train.py", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("gpukit launch: error: could not write the checkpoint of step 1 in ck")
    assert "the disk is full (ENOSPC)" in line
    assert line.endswith("(CheckpointWriteError at train.py:14)")


@pytest.mark.processes
def test_bad_input_under_gpukit_train_on_two_ranks_is_said_once(tmp_path: Path) -> None:
    """As in one process: `gpukit train: error: ...` and exit 2, not a crash report."""
    (tmp_path / "workloads_here.py").write_text(WORKLOADS)
    args = ("--workload", "workloads_here:vector_loss", "--max-steps", "2")
    alone = _gpukit("train", *args, cwd=tmp_path)
    both = _gpukit("train", "--devices", "2", *args, cwd=tmp_path)
    assert (alone.returncode, both.returncode) == (2, 2), both.stderr
    errors = [ln for ln in both.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith("gpukit train: error: rt.train_step's")
    assert "reduce it to one with .mean()" in errors[0]
    assert "Traceback" not in both.stderr and "first failure" not in both.stderr


def test_warn_user_is_quiet_on_ranks_other_than_0(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:  # undone before the fixtures look for a group
        patch.setattr(torch.distributed, "is_initialized", lambda: True)
        patch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            warn_user("said by rank 0 only")
        assert seen == []
        patch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
        with pytest.warns(UserWarning, match="said by rank 0 only"):
            warn_user("said by rank 0 only")
