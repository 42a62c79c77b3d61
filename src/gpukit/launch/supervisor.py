"""One attempt of a job: start every rank, watch them, stop them all when one fails or hangs.

The attempt's thread waits on one queue: the waiting threads of the workers post a rank the
moment it ends, the launcher's signal handlers post the signal, and every ~0.15 s it wakes
anyway to read the heartbeats. After the first failure the other ranks get a short grace (they
usually fail on their own, on the broken connection, which dates their failure) and are then
SIGKILLed with their process groups: never SIGTERM, which asks a gpukit rank to save and stop.

SIGTERM or SIGINT to the launcher is forwarded to every rank as SIGTERM (they finish the step,
save and exit 143) and the launcher waits up to ``stop_timeout`` seconds before killing them; the
user's second Ctrl-C kills them at once, copies of the first request count once. A rank whose
heartbeat says it was asked to stop, or that ended by SIGTERM or SIGINT (a scheduler signalled
that one process), has the request relayed to the others, once; the ranks of a gpukit Runtime
also tell each other through their process group's store.

On several nodes the attempt's ranks are this node's share of the job (global ranks
``node * nproc + local rank``), and the watch also hears the other nodes
(``node_messages.NodeLink``): a failure or a stop request on any node stops every node's ranks
alike.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gpukit.launch import heartbeat
from gpukit.launch.failures import (
    ErrorRecord,
    Fault,
    RankEnd,
    failures,
    first_line,
    read_error,
)
from gpukit.launch.hang_reports import REPORT_FILE, Frame, stack_file, wait_for_dumps
from gpukit.launch.hang_watch import HangWatch, Local
from gpukit.launch.node_channel import LocalPeers, Peers
from gpukit.launch.node_messages import NodeLink
from gpukit.launch.restarts import Progress
from gpukit.launch.signals import SECOND_SIGNAL_AFTER_S
from gpukit.launch.starters import RankStarter
from gpukit.launch.workers import Worker

POLL_S = 0.15  # how often heartbeats are read


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every attempt of a job shares; built by name, since many of its fields are numbers
    that a position would mix up."""

    ranks: RankStarter  # how each rank's process starts: a command, or forks for a function
    nproc: int
    env: dict[str, str]
    folder: Path
    max_restarts: int
    hang_timeout: float | None
    grace: float  # seconds the other ranks get to fail on their own after the first failure
    stop_timeout: float  # seconds ranks get to save and exit after a forwarded SIGTERM
    name: str
    out: TextIO
    startup_timeout: float | None = None  # seconds from a rank's start to its first beat
    on_attempt: Callable[[Attempt, Outcome], None] | None = None  # told how each one ended


class Signals:
    """SIGTERM and SIGINT to the launcher, noted and posted to the attempt's queue; installed
    only from the main thread (Python allows no other), restored by ``restore``.

    Copies of the first request do not count twice (a scheduler signals the launcher and its
    ranks alike, a terminal's Ctrl-C reaches every process of its group): only a SIGINT that
    comes ``SECOND_SIGNAL_AFTER_S`` or more after the first is the user's second Ctrl-C, which
    stops the ranks at once (``forced``)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.forced = False
        self.events: queue.SimpleQueue[int] | None = None
        self._first: float | None = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.received.append(signum)
        elif signum == signal.SIGINT and now - self._first >= SECOND_SIGNAL_AFTER_S:
            self.forced = True
        else:
            return  # a copy of the first request
        if self.events is not None:
            self.events.put(-signum)  # SimpleQueue.put is safe in a signal handler

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


@dataclass
class Outcome:
    """How an attempt ended."""

    status: str  # "ok", "failed", "hung", "preempted" or "rescale" (nodes joined)
    ends: list[RankEnd]
    progress: Progress
    fault: Fault | None = None
    detected_at: float | None = None  # when the failure happened or the hang was seen
    stopped_at: float | None = None  # when the last worker was gone
    preempted_message: str | None = None
    stopping: bool = False  # a stop was requested (signal, a rank's request, another node)
    lost: str | None = None  # a node that sent no report at the end (several nodes)

    @property
    def stop_s(self) -> float | None:
        if self.detected_at is None or self.stopped_at is None:
            return None
        return max(self.stopped_at - self.detected_at, 0.0)


@dataclass
class Attempt:
    """Attempt number ``number`` of a job, its ranks on ``port``: this node's ranks of the
    job's, its place in the job and the other nodes given by ``peers``."""

    settings: Settings
    number: int
    port: int
    signals: Signals
    resumes_from: int = 0  # the step of the last checkpoint known (0: none)
    workers: list[Worker] = field(default_factory=list)
    peers: Peers = field(default_factory=LocalPeers)  # the other nodes' launchers
    master_addr: str = "127.0.0.1"
    waiting: Callable[[], int] | None = None  # nodes waiting to join (elastic), asked by node 0

    def run(self) -> Outcome:
        s = self.settings
        events: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.signals.events = events
        progress = Progress(time.time(), s.nproc, self.resumes_from)
        base = self.peers.node * s.nproc  # Worker.rank is the rank in the whole job
        self.workers = [
            s.ranks.start(base + local, self._env(base + local, local), events)
            for local in range(s.nproc)
        ]
        watch = _Watch(self, progress)
        handled = 0  # a signal that came between two attempts stops this one at once
        while any(w.alive for w in self.workers):
            with contextlib.suppress(queue.Empty):
                events.get(timeout=POLL_S)
            news = len(self.signals.received) + self.signals.forced
            if news > handled:
                handled = news
                watch.on_signals()
            watch.check(time.time())
        for worker in self.workers:
            worker.kill()  # what a rank left behind in its group (DataLoader workers)
        outcome = watch.outcome()
        outcome.stopping = watch.stopping
        if s.on_attempt is not None:
            s.on_attempt(self, outcome)
        return outcome

    def _env(self, rank: int, local: int | None = None) -> dict[str, str]:
        s = self.settings
        return {
            **s.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank if local is None else local),
            "WORLD_SIZE": str(s.nproc * self.peers.nnodes),
            "LOCAL_WORLD_SIZE": str(s.nproc),
            "GROUP_RANK": str(self.peers.node),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(s.nproc * self.peers.nnodes),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_ERROR_FILE": str(self.error_file(rank)),
            "TORCHELASTIC_RESTART_COUNT": str(self.number),
            "TORCHELASTIC_MAX_RESTARTS": str(s.max_restarts),
            "GPUKIT_JOB_DIR": str(s.folder),
            "GPUKIT_ATTEMPT": str(self.number),
        }

    def error_file(self, rank: int) -> Path:
        return self.settings.folder / f"error-{rank}-{self.number}.json"


class _Watch:
    """The attempt's state between wake-ups: failures seen, deadlines, heartbeats."""

    def __init__(self, attempt: Attempt, progress: Progress) -> None:
        self.attempt = attempt
        self.progress = progress
        self.seen: set[int] = set()
        self.first_failure: float | None = None
        self.kill_at: float | None = None
        self.stopping = False  # asked to stop: by a signal, a rank's request, a 143 exit
        self.signalled: set[int] = set()  # ranks sent SIGTERM by the launcher
        self.hang: tuple[Fault, float] | None = None
        s = attempt.settings
        self.hangs = HangWatch(attempt.peers, s.hang_timeout, s.startup_timeout, s.name)
        self.failed: set[int] = set()  # ranks that ended failing (not stopped, not preempted)
        self.cut_short = 0  # graces ended early: every rank left waited on a failed one
        self.link = NodeLink(attempt.peers, attempt.waiting)

    @property
    def _settings(self) -> Settings:
        return self.attempt.settings

    def _deadline(self, at: float) -> None:
        self.kill_at = at if self.kill_at is None else min(self.kill_at, at)

    def _terminate(self, workers: list[Worker]) -> None:
        for w in workers:
            if w.alive:
                self.signalled.add(w.rank)
                w.send(signal.SIGTERM)

    def on_signals(self) -> None:
        if self.attempt.signals.forced:
            self.kill_all()  # the user's second Ctrl-C: stop now
            return
        self.stopping = True
        self.link.tell_stop("signal")
        self._terminate(
            [
                w
                for w in self.attempt.workers
                if w.rank not in self.signalled and not self._asked_to_stop(w.rank)
            ]
        )
        self._deadline(time.time() + self._settings.stop_timeout)

    def kill_all(self) -> None:
        for w in self.attempt.workers:
            if w.alive:
                w.kill()

    def check(self, now: float) -> None:
        for w in self.attempt.workers:
            if not w.alive and w.rank not in self.seen:
                self.seen.add(w.rank)
                self._ended(w, now)
        self._read_beats()
        self._hear(now)
        if self.hangs.active and self.first_failure is None and self.hang is None:
            self._check_hang(now)
        if self.first_failure is not None and not self.stopping and self._peers_blocked(now):
            self._deadline(now)  # the grace would only date their consequences
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_all()

    def _ended(self, worker: Worker, now: float) -> None:
        code = worker.returncode
        if code is None or code == 0 or worker.stopped:
            return
        if RankEnd(worker.rank, code, 0).preempted:
            if not self.stopping:  # it was asked to stop by someone else: so are the others
                self._terminate([w for w in self.attempt.workers if w is not worker])
                self.link.tell_stop("rank")
            self.stopping = True
            self._deadline(now + self._settings.stop_timeout)
            return
        self.failed.add(worker.rank)
        if self.first_failure is None:
            self.link.tell_failure(self._end(worker))
            self.first_failure = now
            # While the ranks save on their way out, a peer's failure must not cut that short.
            self._deadline(
                now + (self._settings.stop_timeout if self.stopping else self._settings.grace)
            )

    def _read_beats(self) -> None:
        folder, number = self._settings.folder, self.attempt.number
        for w in self.attempt.workers:
            beat = heartbeat.read(folder, w.rank)
            if beat is None or beat.attempt != number:
                continue  # not beaten yet in this attempt (the file may be the last attempt's)
            self.progress.observe(beat)
            if beat.stop_requested and not self.stopping:
                # One rank got the scheduler's SIGTERM: relay it to the others, once.
                self.stopping = True
                self.link.tell_stop("rank")
                others = [x for x in self.attempt.workers if x is not w]
                self._terminate([x for x in others if not self._asked_to_stop(x.rank)])

    def _peers_blocked(self, now: float) -> bool:
        """Every rank still running stands in a call where ranks meet (its heartbeat's phase)
        that a failed rank never made (it counts more such calls than that rank's last beat),
        with no error recorded: it can only end by its backend's error on the lost peer, a
        consequence, so the grace would teach nothing. A rank without a beat in this attempt,
        out of such a call, or that recorded an error (it failed: its exit is awaited) keeps
        the grace."""
        folder, number = self._settings.folder, self.attempt.number
        if self.hang is not None or not self.failed:
            return False
        dead = [heartbeat.read(folder, rank) for rank in self.failed]
        fewest = min(b.calls if b is not None and b.attempt == number else 0 for b in dead)
        alive = [w for w in self.attempt.workers if w.alive]
        for w in alive:
            beat = self.progress.last.get(w.rank)
            if beat is None or beat.phase not in heartbeat.MEETING_PHASES or beat.calls <= fewest:
                return False
            if self.attempt.error_file(w.rank).exists():
                return False
        if alive and self.kill_at is not None and self.kill_at > now:
            self.cut_short += 1
        return bool(alive)

    def _hear(self, now: float) -> None:
        """The other nodes' news: a failure there stops the ranks here after the grace, as a
        failure here would; a stop request there is relayed here."""
        news = self.link.news(healthy=self.first_failure is None and not self.stopping)
        if news == "failure" and self.first_failure is None:
            self.first_failure = now
            s = self._settings
            self._deadline(now + (s.stop_timeout if self.stopping else s.grace))
        elif news in ("stop", "rescale") and not self.stopping:
            self.stopping = True
            workers = self.attempt.workers
            self._terminate([w for w in workers if not self._asked_to_stop(w.rank)])
            self._deadline(now + self._settings.stop_timeout)

    def _asked_to_stop(self, rank: int) -> bool:
        beat = self.progress.last.get(rank)
        return beat is not None and beat.stop_requested

    def _check_hang(self, now: float) -> None:
        ranks = [
            Local(w.rank, w.started, self.progress.last.get(w.rank), w.alive)
            for w in self.attempt.workers
        ]
        found = self.hangs.check(now, ranks, self._dump_stacks)
        if found is None:
            return
        s, number = self._settings, self.attempt.number
        kept = f"  stack dumps and {REPORT_FILE} are kept in {s.folder}"
        (s.folder / REPORT_FILE).write_text(f"attempt {number}\n{found.report}\n")
        print(f"{found.report}\n{kept}", file=s.out, flush=True)
        fault = Fault("hung", found.rank, found.where, found.step, found.text, number)
        self.hang = (fault, now)
        self.first_failure = now
        self.kill_all()

    def _dump_stacks(self) -> dict[int, list[Frame]]:
        """Every live rank of this node writes its stacks (SIGUSR1); its main thread's."""
        s, number = self._settings, self.attempt.number
        alive = [w for w in self.attempt.workers if w.alive]
        for w in alive:
            w.send(signal.SIGUSR1)
        return wait_for_dumps({w.rank: stack_file(s.folder, w.rank, number) for w in alive})

    def outcome(self) -> Outcome:
        ends = [self._end(w) for w in self.attempt.workers]
        stopped_at = max((w.ended_ns or 0) for w in self.attempt.workers) / 1e9
        progress, number = self.progress, self.attempt.number
        if self.hang is not None:
            fault, seen = self.hang
            return Outcome("hung", ends, progress, fault, seen, stopped_at)
        failed = failures(ends)  # the first failure first (a rank that diverged, if one did)
        # Asked to stop, ranks that only lost a peer on the way out did not fail the job.
        stop_only = self.stopping and all(e.consequence for e in failed)
        if failed and not self.attempt.signals.received and not stop_only:
            first = failed[0]
            fault = first.fault(number, ends)
            return Outcome("failed", ends, progress, fault, first.failed_at_ns / 1e9, stopped_at)
        if self.attempt.signals.received or any(e.preempted for e in ends):
            return Outcome("preempted", ends, progress, preempted_message=_resume_hint(ends))
        return Outcome("ok", ends, progress)  # a stop was relayed, yet every rank finished

    def _end(self, w: Worker) -> RankEnd:
        code = w.returncode
        assert code is not None and w.ended_ns is not None
        beat = self.progress.last.get(w.rank)
        final = heartbeat.read(self._settings.folder, w.rank)  # its very last beat
        if final is not None and final.attempt == self.attempt.number:
            beat = final
            self.progress.observe(final)
        return RankEnd(
            w.rank,
            code,
            w.ended_ns,
            read_error(self.attempt.error_file(w.rank)),
            stopped=w.stopped and code == -signal.SIGKILL,
            step=beat.step if beat is not None else None,
            phase=beat.phase if beat is not None else None,
            asked_to_stop=w.rank in self.signalled,
            where_called=beat.where if beat is not None else "",
            calls=beat.calls if beat is not None else 0,
        )


def _resume_hint(ends: list[RankEnd]) -> str | None:
    """What a rank that stopped on request said (gpukit's Preempted: where it saved and how to
    resume), rank 0's first."""
    for end in sorted(ends, key=lambda e: e.rank):
        error: ErrorRecord | None = end.error
        if error is not None and error.message.startswith("Preempted"):
            return first_line(error.message, width=1000).removeprefix("Preempted: ")
    return None


def fresh_job_dir() -> Path:
    """A new folder for one job's heartbeats, error records and stack dumps."""
    return Path(tempfile.mkdtemp(prefix=f"gpukit-job-{os.getpid()}-"))
