"""What a restart waits for: the launcher's grace after a failure ends as soon as every rank
left waits on the failed one, a failed process leaves without the interpreter's collections,
and each attempt's times are kept for ``gpukit bench restarts``. Counts and events only."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpukit.launch import RUNNER, run_job
from gpukit.launch.attempt_watch import AttemptWatch
from gpukit.launch.heartbeat import Heartbeat
from gpukit.launch.restarts import ATTEMPTS_FILE, Progress
from gpukit.launch.signals import Signals
from gpukit.launch.starters import CommandStarter
from gpukit.launch.supervisor import Attempt, Settings

GRACE = 1.5


@dataclass
class FakeWorker:
    """A rank's process as the watch sees it, without a process."""

    rank: int
    returncode: int | None = None
    stopped: bool = False
    kills: int = 0

    @property
    def alive(self) -> bool:
        return self.returncode is None

    @property
    def ended_ns(self) -> int | None:
        return None if self.alive else 1

    def kill(self) -> None:
        self.kills += 1
        if self.alive:
            self.stopped = True
            self.returncode = -9

    def send(self, sig: int) -> None:
        pass


def watch_of(folder: Path, workers: list[FakeWorker]) -> AttemptWatch:
    settings = Settings(
        ranks=CommandStarter(["x"]),
        nproc=len(workers),
        env={},
        folder=folder,
        max_restarts=1,
        hang_timeout=None,
        grace=GRACE,
        stop_timeout=25.0,
        name="gpukit launch",
        out=io.StringIO(),
    )
    attempt = Attempt(settings, 0, 0, Signals.__new__(Signals))
    attempt.workers = workers  # type: ignore[assignment]
    return AttemptWatch(attempt, Progress(0.0, len(workers)))


def beats(folder: Path, rank: int, *phases: str) -> None:
    """Rank ``rank`` beats through ``phases`` (each a call where ranks meet counts one)."""
    heart = Heartbeat(folder, rank)
    for phase in phases:
        heart.beat(phase, 2)


STEP = ("forward", "backward", "optimizer")  # two calls where ranks meet


@pytest.mark.parametrize(
    ("survivor", "error", "cut"),
    [
        (("setup", *STEP, *STEP, "forward", "backward"), False, True),  # waits in call 5
        (("setup", *STEP, *STEP), False, False),  # in call 5 with the dead: a divergence, maybe
        (("setup", *STEP, *STEP, "forward"), False, False),  # computing: may fail on its own
        (("setup", *STEP, *STEP, "forward", "backward"), True, False),  # failed: its exit waits
    ],
    ids=["blocked", "same-call", "not-in-a-call", "recorded-its-error"],
)
def test_the_grace_ends_early_only_when_every_rank_left_waits_on_the_failed_one(
    tmp_path: Path, survivor: tuple[str, ...], error: bool, cut: bool
) -> None:
    dead, alive = FakeWorker(1, returncode=1), FakeWorker(0)
    beats(tmp_path, 1, "setup", *STEP, *STEP)  # 5 calls, then it raised at the next forward
    beats(tmp_path, 0, *survivor)
    watch = watch_of(tmp_path, [alive, dead])
    if error:
        watch.attempt.error_file(0).write_text("{}")
    watch.check(100.0)
    assert watch.first_failure == 100.0
    assert (alive.kills, alive.stopped, watch.cut_short) == ((1, True, 1) if cut else (0, False, 0))
    assert watch.kill_at == (100.0 if cut else 100.0 + GRACE)


def test_the_grace_is_kept_while_ranks_save_on_request(tmp_path: Path) -> None:
    dead, alive = FakeWorker(1, returncode=1), FakeWorker(0)
    beats(tmp_path, 1, "setup")
    beats(tmp_path, 0, "setup", "forward", "backward")
    watch = watch_of(tmp_path, [alive, dead])
    watch.stopping = True  # a preemption: the others save on their way out
    watch.check(100.0)
    assert (alive.kills, watch.cut_short) == (0, 0)


def test_a_rank_without_a_beat_keeps_the_grace(tmp_path: Path) -> None:
    dead, alive = FakeWorker(1, returncode=1), FakeWorker(0)
    watch = watch_of(tmp_path, [alive, dead])
    watch.check(100.0)
    assert (alive.kills, watch.cut_short, watch.kill_at) == (0, 0, 100.0 + GRACE)


@pytest.mark.processes
def test_a_failed_script_leaves_with_its_objects_frozen_and_a_finished_one_without(
    tmp_path: Path,
) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0, flush=True))\n"
        "if sys.argv[1] == 'raise': raise ValueError('bad')\n"
        "if sys.argv[1] == 'exit': sys.exit(3)\n"
    )
    for how, code, frozen in (("raise", 1, True), ("exit", 3, True), ("finish", 0, False)):
        done = subprocess.run(
            [sys.executable, str(RUNNER), str(script), how],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert (done.returncode, done.stdout) == (code, f"frozen {frozen}\n"), done.stderr


@pytest.mark.processes
def test_each_attempt_records_its_times_and_ends(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, sys\nsys.exit(int(os.environ['RANK']) * 5)\n")
    out = io.StringIO()
    command = [sys.executable, str(RUNNER), str(script)]
    assert run_job(command, 2, out=out, job_dir=tmp_path / "job") == 1
    lines = (tmp_path / "job" / ATTEMPTS_FILE).read_text().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["attempt"] == 0 and record["first_step"] is None
    assert {rank: end[1:] for rank, end in record["ends"].items()} == {
        "0": [0, False],
        "1": [5, False],
    }
    assert record["started"] <= record["failed"] <= record["gone"]
    (ended,) = [json.loads(line) for line in (tmp_path / "job" / "events.jsonl").open()]
    assert (ended["kind"], ended["code"], ended["text"]) == ("ended", 1, "the job failed (exit 1)")


@pytest.mark.parametrize(
    "said",
    [None, "RuntimeError: checkpoint load interrupted"],
    ids=["no-record", "not-a-lost-peer-message"],
)
def test_a_stop_signal_from_outside_during_start_up_is_a_stop_not_a_failure(
    tmp_path: Path, said: str | None
) -> None:
    # Rank 0 took a scheduler's SIGTERM while it loaded (no handler yet: it died of it); rank
    # 1, mid-load with it, failed in its own words. The job stops (143): no restart.
    stopped, broken = FakeWorker(0, returncode=-15), FakeWorker(1, returncode=1)
    beats(tmp_path, 0, "setup", "load")
    beats(tmp_path, 1, "setup", "load")
    watch = watch_of(tmp_path, [stopped, broken])
    watch.attempt.signals.received = []  # the launcher itself was not signalled
    if said is not None:
        record = {"message": {"message": said, "extraInfo": {"time_ns": 1}}}
        watch.attempt.error_file(1).write_text(json.dumps(record))
    watch.check(100.0)
    assert watch.outcome().status == "preempted"


def test_a_failure_without_a_stop_from_outside_is_still_a_failure(tmp_path: Path) -> None:
    killed, broken = FakeWorker(0, returncode=-9), FakeWorker(1, returncode=1)
    beats(tmp_path, 0, "setup", "load")
    beats(tmp_path, 1, "setup", "load")
    watch = watch_of(tmp_path, [killed, broken])
    watch.attempt.signals.received = []
    watch.check(100.0)
    assert watch.outcome().status == "failed"
