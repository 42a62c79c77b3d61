"""The launcher's events of the job reach rank 0's loggers: a straggler named and recovered,
read from a job folder written here as gpukit's launcher writes it (JOB/events.jsonl, and the
eight-byte count in JOB/events.count, bumped after each line)."""

from __future__ import annotations

import csv
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.runtime.outputs.job_events import COUNT_FILE, EVENTS_FILE, JobEvents


class Launcher:
    """The writing end: appends an event, then bumps the mapped count."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        path = folder / COUNT_FILE
        path.write_bytes(bytes(8))
        fd = os.open(path, os.O_RDWR)
        self.count = mmap.mmap(fd, 8)
        os.close(fd)
        self.lines = 0

    def event(self, kind: str, rank: int = 1, **more: Any) -> None:
        line = {"time": 1.0, "kind": kind, "attempt": 0, "rank": rank, "node": 0, **more}
        with (self.folder / EVENTS_FILE).open("a") as file:
            file.write(json.dumps(line) + "\n")
        self.lines += 1
        self.count[:8] = self.lines.to_bytes(8, "little", signed=True)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Launcher:
    folder = tmp_path / "job"
    folder.mkdir()
    monkeypatch.setenv("GPUKIT_JOB_DIR", str(folder))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return Launcher(folder)


def _steps(rt: gk.Runtime, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        x = torch.randn(4, 3)
        loss = model(x).pow(2).mean()
        rt.backward(loss)
        rt.step(opt)
        rt.log(loss=loss)


def test_a_straggler_and_its_recovery_reach_the_loggers(job: Launcher, tmp_path: Path) -> None:
    job.event("restart")  # before the run started: an earlier attempt's, not told again
    job.event("straggler", rank=0, slowdown=9.0)
    out = tmp_path / "csv"
    rt = gk.Runtime(
        strategy="single", devices="cpu", log_every=2, loggers=[gk.loggers.CsvLogger(out)]
    )
    net = nn.Linear(3, 1)
    model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    _steps(rt, model, opt, 3)
    job.event("straggler", rank=1, slowdown=2.4, step=3, phase="data", text="rank 1 is slow")
    job.event("hang", rank=1)  # not a logger's
    _steps(rt, model, opt, 2)  # the flush at step 4 tells it
    job.event("straggler-recovered", rank=1)
    _steps(rt, model, opt, 2)
    rt.teardown()
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    told = [
        {k: v for k, v in row.items() if k.startswith("straggler/") and v}
        for row in rows
        if any(row[k] for k in row if k.startswith("straggler/"))
    ]
    assert told == [
        {"straggler/rank": "1", "straggler/slowdown": "2.4"},
        {"straggler/recovered_rank": "1"},
    ]
    steps = [row["step"] for row in rows if any(row[k] for k in row if k.startswith("straggler/"))]
    assert steps == ["4", "6"]  # at the step of the record they follow
    assert [row["step"] for row in rows if row["loss"]] == ["2", "4", "6"]


def test_lines_still_being_written_or_unreadable_are_never_an_error(job: Launcher) -> None:
    events = JobEvents.open(job.folder)
    assert events is not None and events.news() == []
    with (job.folder / EVENTS_FILE).open("a") as file:
        file.write("not json\n")
        file.write('{"kind": "straggler", "rank": "x"}\n')
    job.lines += 2
    job.event("straggler", rank=2, slowdown=1.5)
    with (job.folder / EVENTS_FILE).open("a") as file:
        file.write('{"kind": "straggler", "ra')  # the launcher's next line, half written
    assert events.news() == [{"straggler/rank": 2, "straggler/slowdown": 1.5}]
    assert events.news() == []
    with (job.folder / EVENTS_FILE).open("a") as file:
        file.write('nk": 3, "slowdown": 2.0}\n')
    job.lines += 1
    job.count[:8] = job.lines.to_bytes(8, "little")
    assert events.news() == [{"straggler/rank": 3, "straggler/slowdown": 2.0}]
    (job.folder / EVENTS_FILE).unlink()  # a disk that lost the record: nothing, and no retry
    job.lines += 1
    job.count[:8] = job.lines.to_bytes(8, "little")
    assert events.news() == [] and events.news() == []
    events.close()


def test_without_a_launchers_counter_nothing_is_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert JobEvents.open(None) is None
    assert JobEvents.open(tmp_path) is None  # no events.count
    (tmp_path / COUNT_FILE).write_bytes(b"")  # not a counter
    assert JobEvents.open(tmp_path) is None
    monkeypatch.setenv("GPUKIT_JOB_DIR", str(tmp_path))
    rt = gk.Runtime(devices="cpu", loggers=[gk.loggers.CsvLogger(tmp_path / "csv")])
    assert rt._reporting.events is None
    rt.teardown()


def test_only_rank_zero_with_loggers_maps_the_counter(job: Launcher) -> None:
    assert gk.Runtime(strategy="single", devices="cpu")._reporting.events is None  # no logger
    rt = gk.Runtime(strategy="single", devices="cpu", loggers=[gk.loggers.CsvLogger(job.folder)])
    assert rt._reporting.events is not None
    rt.teardown()


JOB = """
import os, sys
from pathlib import Path
import torch
from torch import nn
import gpukit as gk

job, rank = Path(os.environ["GPUKIT_JOB_DIR"]), int(os.environ["RANK"])
if rank == 0:  # as gpukit's launcher does before it starts the ranks
    (job / "events.count").write_bytes(bytes(8))
torch.manual_seed(0)
csv_logger = gk.loggers.CsvLogger(sys.argv[1])
rt = gk.Runtime(strategy="ddp", devices="cpu", log_every=2, loggers=[csv_logger])
net = nn.Linear(3, 1)
model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for step in range(1, 7):
    loss = model(torch.randn(4, 3)).pow(2).mean()
    rt.backward(loss)
    rt.step(opt)
    rt.log(loss=loss)
    if step == 3:  # rank 1 writes the launcher's event: the job names it a straggler
        rt.barrier()
        if rank == 1:
            with (job / "events.jsonl").open("a") as file:
                file.write('{"kind": "straggler", "rank": 1, "slowdown": 1.8, "step": 3}\\n')
            with (job / "events.count").open("r+b") as file:
                file.write((1).to_bytes(8, "little"))
        rt.barrier()
rt.teardown()
"""


@pytest.mark.processes
def test_rank_zero_of_a_launched_job_tells_its_loggers(tmp_path: Path) -> None:
    script, out = tmp_path / "job.py", tmp_path / "csv"
    script.write_text(JOB)
    command = [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", str(script), str(out)]
    done = subprocess.run(
        command, text=True, capture_output=True, timeout=120, cwd=tmp_path, check=False
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    told = [(row["step"], row["straggler/rank"], row["straggler/slowdown"]) for row in rows]
    assert ("4", "1", "1.8") in told and len([t for t in told if t[1]]) == 1
