"""The launcher's view of a job, on synthetic beats: live.json once a second, stragglers
said and recorded (JOB and --out), samples, several nodes' ranks through their posts."""

from __future__ import annotations

import io
import json
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpukit.launch.attempt_watch import AttemptWatch
from gpukit.launch.hang_watch import Found
from gpukit.launch.heartbeat import PHASES, Beat
from gpukit.launch.job import _how
from gpukit.launch.job_records import (
    COUNT_FILE,
    EVENTS_FILE,
    JOB_FILE,
    LIVE_FILE,
    RANKS_FILE,
    JobRecord,
)
from gpukit.launch.job_view import STALE_S, JobView
from gpukit.launch.node_channel import LocalPeers
from gpukit.launch.restarts import Progress
from gpukit.launch.signals import Signals
from gpukit.launch.starters import CommandStarter
from gpukit.launch.supervisor import Attempt, Settings
from tests.launch.test_restart_speed import FakeWorker as Process


@dataclass
class FakeWorker:
    rank: int
    pid: int = 2**22 + 1  # no such process: its RSS is unknown
    alive: bool = True


@dataclass
class FakeAttempt:
    workers: list[FakeWorker]
    peers: Any = field(default_factory=LocalPeers)
    number: int = 0


class SharedPeers:
    """Two nodes' launchers in one test: one dict for a store."""

    def __init__(self, store: dict[str, Any], node: int) -> None:
        self.store, self.node, self.nnodes = store, node, 2

    def post(self, key: str, value: dict[str, Any]) -> None:
        self.store[key] = json.loads(json.dumps(value))

    def read(self, key: str) -> dict[str, Any] | None:
        return self.store.get(key)


def beat(rank: int, step: int, now: float, data_s: float, backward_s: float) -> Beat:
    """Rank ``rank`` at ``step`` after ``step`` steps of ``data_s`` + 10 ms forward, then
    ``backward_s`` waiting in the backward."""
    spent = {"data": step * data_s, "forward": step * 0.01, "backward": step * backward_s}
    return Beat(
        rank=rank,
        time=now,
        step=step,
        saved_step=-1,
        pid=1,
        phase="backward",
        stop_requested=False,
        attempt=0,
        where="rt.backward at train.py:20",
        spent=tuple(spent.get(p, 0.0) for p in PHASES),
        last_step_s=0.05,
        samples_per_step=4,
    )


def view_of(tmp_path: Path, attempt: FakeAttempt, said: list[str], **record: Any) -> JobView:
    job = tmp_path / f"job{attempt.peers.node}"
    job.mkdir()
    kept = JobRecord(job, "gpukit launch", ["train.py"], **record)
    kept.attempt_begins(attempt.peers.node, attempt.number)
    return JobView(kept, attempt, len(attempt.workers), None, said.append)


def feed(progress: Progress, ranks: list[int], step: int, now: float, slow: int | None) -> None:
    """Every rank at ``step``: ``slow`` spends 40 ms a step in data, the others 2 ms and
    wait in the backward for it."""
    for rank in ranks:
        if rank == slow:
            progress.last[rank] = beat(rank, step, now, 0.04, 0.0)
        else:
            progress.last[rank] = beat(rank, step, now, 0.002, 0.038)


def test_live_json_names_a_straggler_and_the_records_keep_it(tmp_path: Path) -> None:
    said: list[str] = []
    out = tmp_path / "out"
    out.mkdir()
    view = view_of(
        tmp_path, FakeAttempt([FakeWorker(0), FakeWorker(1)]), said, out=out, total_steps=200
    )
    record = view.record
    assert (out / JOB_FILE).read_text() == f"{record.folder}\n"
    progress = Progress(0.0, 2)
    for second in range(6):
        feed(progress, [0, 1], step=20 * second, now=100.0 + second, slow=1)  # 50 ms steps
        view.tick(100.0 + second, progress)
    assert len(said) == 1 and said[0].startswith("straggler: rank 1 (node 0, host ")
    assert "mostly in data (+38 ms per step)" in said[0]
    live = json.loads((record.folder / LIVE_FILE).read_text())
    assert live["step"] == 100 and live["total_steps"] == 200 and live["world_size"] == 2
    assert live["eta_s"] == 5.0  # 100 steps at the slowest median, 50 ms
    assert live["samples_per_s"] == 160.0  # 4 samples per 50 ms step, on each of 2 ranks
    assert [s["rank"] for s in live["stragglers"]] == [1]
    rank0, rank1 = live["ranks"]
    assert rank0["shares"] == {"data": 0.04, "coll": 0.76, "compute": 0.2}
    assert rank1["shares"]["coll"] == 0.0 and rank1["phase"] == "backward"
    assert rank1["memory"] == {"allocated": None, "peak": None, "reserved": None, "rss": None}
    assert rank1["where"] == "rt.backward at train.py:20" and rank1["gpu"] is None
    events = (record.folder / EVENTS_FILE).read_text().splitlines()
    assert [json.loads(e)["kind"] for e in events] == ["straggler"]
    assert (out / EVENTS_FILE).read_text().splitlines() == events
    with open(record.folder / COUNT_FILE, "rb") as counter:
        assert struct.unpack("<q", mmap.mmap(counter.fileno(), 8, access=mmap.ACCESS_READ))[0] == 1
    samples = [json.loads(line) for line in (out / RANKS_FILE).read_text().splitlines()]
    assert len(samples) == 6 and "where" not in samples[-1]["ranks"][0]  # 1 s apart at first
    record.end(0, "finished", 0)
    live = json.loads((record.folder / LIVE_FILE).read_text())
    assert live["ended"]["code"] == 0 and live["stragglers"] == []
    assert live["events"][-1]["kind"] == "ended"


def test_the_view_refreshes_at_most_once_a_second(tmp_path: Path) -> None:
    view = view_of(tmp_path, FakeAttempt([FakeWorker(0)]), [])
    progress = Progress(0.0, 1)
    view.tick(10.0, progress)
    view.tick(10.5, progress)
    assert json.loads((view.record.folder / LIVE_FILE).read_text())["updated"] == 10.0
    view.tick(11.0, progress)
    assert json.loads((view.record.folder / LIVE_FILE).read_text())["updated"] == 11.0


def test_every_node_shows_the_whole_job_and_a_silent_node_goes_stale(tmp_path: Path) -> None:
    store: dict[str, Any] = {}
    said: list[str] = []
    nodes = [
        view_of(
            tmp_path,
            FakeAttempt([FakeWorker(2 * n), FakeWorker(2 * n + 1)], SharedPeers(store, n)),
            said,
        )
        for n in range(2)
    ]
    progresses = [Progress(0.0, 2), Progress(0.0, 2)]
    for second in range(6):
        for n, view in enumerate(nodes):
            feed(progresses[n], [2 * n, 2 * n + 1], 10 * second, 100.0 + second, slow=3)
            view.tick(100.0 + second, progresses[n])
    assert len(said) == 1 and said[0].startswith("straggler: rank 3 (node 1, host ")
    for n, view in enumerate(nodes):
        live = json.loads((view.record.folder / LIVE_FILE).read_text())
        assert [(r["rank"], r["node"]) for r in live["ranks"]] == [(0, 0), (1, 0), (2, 1), (3, 1)]
        assert [s["rank"] for s in live["stragglers"]] == [3], n
        assert [node["stale"] for node in live["nodes"]] == [False, False]
    # Node 1 stops posting: node 0 keeps its ranks as last heard, and says it.
    nodes[0].tick(106.0, progresses[0])  # hears node 1's last post
    nodes[0].tick(106.0 + STALE_S + 1, progresses[0])
    live = json.loads((nodes[0].record.folder / LIVE_FILE).read_text())
    assert live["nodes"][1]["stale"] and live["ranks"][3]["stale"]
    assert any(note.startswith("node 1: no news for ") for note in live["notes"])
    # Only node 0 judges: node 1 recorded no straggler of its own.
    assert not (nodes[1].record.folder / EVENTS_FILE).exists()


def test_a_hang_the_watch_reports_is_an_event_with_its_report(
    tmp_path: Path, monkeypatch: Any
) -> None:
    record = JobRecord(tmp_path, "gpukit launch", ["x"])
    settings = Settings(
        ranks=CommandStarter(["x"]),
        nproc=2,
        env={},
        folder=tmp_path,
        max_restarts=0,
        hang_timeout=3.0,
        grace=1.5,
        stop_timeout=25.0,
        name="gpukit launch",
        out=io.StringIO(),
        record=record,
    )
    attempt = Attempt(settings, 0, 0, Signals.__new__(Signals))
    workers = [Process(0), Process(1)]
    for w in workers:
        w.started = 0.0  # type: ignore[attr-defined]
    attempt.workers = workers  # type: ignore[assignment]
    watch = AttemptWatch(attempt, Progress(0.0, 2))
    found = Found("hang", 1, 0, 7, "train.py:9", "rank 1 hung at step 7 (phase loop)", "REPORT")
    monkeypatch.setattr(watch.hangs, "check", lambda *args: found)
    watch.check(100.0)
    (event,) = [json.loads(line) for line in (tmp_path / EVENTS_FILE).open()]
    assert (event["kind"], event["rank"], event["step"]) == ("hang", 1, 7)
    assert event["text"] == "rank 1 hung at step 7 (phase loop)" and event["report"] == "REPORT"


def test_the_counter_counts_every_line_of_a_job_folder_given_again(tmp_path: Path) -> None:
    first = JobRecord(tmp_path, "gpukit launch", ["x"])
    first.event({"kind": "restart", "text": "restart 1/1"}, attempt=0)
    first.end(1, "failed", 0)
    again = JobRecord(tmp_path, "gpukit launch", ["x"])
    again.event({"kind": "restart", "text": "restart 1/1"}, attempt=0)
    with open(tmp_path / COUNT_FILE, "rb") as counter:
        assert struct.unpack("<q", counter.read(8))[0] == 3 == again.count
    assert len((tmp_path / EVENTS_FILE).read_text().splitlines()) == 3


def test_an_error_in_the_view_is_said_once_and_never_fails_the_job(
    tmp_path: Path, monkeypatch: Any
) -> None:
    out = io.StringIO()
    record = JobRecord(tmp_path, "gpukit launch", ["x"])
    settings = Settings(
        ranks=CommandStarter(["x"]),
        nproc=2,
        env={},
        folder=tmp_path,
        max_restarts=0,
        hang_timeout=0.0,
        grace=1.5,
        stop_timeout=25.0,
        name="gpukit launch",
        out=out,
        record=record,
    )
    attempt = Attempt(settings, 0, 0, Signals.__new__(Signals))
    attempt.workers = [Process(0), Process(1)]  # type: ignore[assignment]
    attempt.signals.received = False  # type: ignore[misc]
    for w in attempt.workers:
        w.pid = 2**22 + 1  # type: ignore[attr-defined]  # no such process
    watch = AttemptWatch(attempt, Progress(0.0, 2))
    assert watch.view is not None

    def broken(*args: Any) -> None:
        raise KeyError("gpu")

    monkeypatch.setattr(watch.view.gpus, "read", broken)
    monkeypatch.setattr(watch.view, "close", broken)
    watch.progress.last[0] = beat(0, 3, 100.0, 0.01, 0.0)  # a beat: the GPU is read
    for second in range(3):
        watch.check(100.0 + second)  # raises nothing
    for w in attempt.workers:
        w.returncode = 0  # type: ignore[misc]
    watch.outcome()  # its close raises too
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("gpukit launch: the job's watch (live.json for gpukit top")
    assert "KeyError: 'gpu'" in lines[0] and "the job goes on" in lines[0]
    record.event({"kind": "restart", "text": "restart 1/1"}, attempt=0)  # still records
    # Said once for the job: a later attempt's failure, or an output that refuses the line,
    # raises nothing either.
    with record.contained(out.write):
        raise OSError("later")
    fresh = JobRecord(tmp_path, "gpukit launch", ["x"])

    def refusing(line: str) -> None:
        raise BrokenPipeError(line)

    with fresh.contained(refusing):
        raise KeyError("gpu")
    assert len(out.getvalue().splitlines()) == 1
    assert (tmp_path / EVENTS_FILE).read_text().count("\n") == 1


def test_the_end_says_hung_only_when_the_last_attempt_hung(tmp_path: Path) -> None:
    record = JobRecord(tmp_path, "gpukit launch", ["x"])
    record.event({"kind": "hang", "rank": 1, "text": "rank 1 hung"}, attempt=0)
    assert _how(1, record) == "hung"
    record.attempt_begins(0, 1)  # restarted: this attempt failed another way
    assert _how(1, record) == "failed"
    record.event({"kind": "hang", "rank": 0, "text": "rank 0 hung"}, attempt=1)
    assert _how(1, record) == "hung" and _how(0, record) == "finished"
