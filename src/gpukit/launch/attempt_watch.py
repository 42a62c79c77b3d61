"""Watching one attempt's ranks between the attempt's wake-ups, and how the attempt ended.

The watch notes each rank that ends, reads the heartbeats, hears the other nodes, and keeps the
deadlines: after the first failure the other ranks get a short grace, cut short when every one
left waits in a collective on a failed rank; a stop request (a signal, a rank's own, another
node's) is relayed once, with ``stop_timeout`` to save; a rank stuck in start-up or hung gets a
report with every rank's stack. At the end it tells the :class:`Outcome`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from gpukit._util.files import write_atomic
from gpukit.errors import OutputWriteError
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
from gpukit.launch.job_records import JobRecord
from gpukit.launch.job_view import JobView
from gpukit.launch.node_channel import Peers
from gpukit.launch.node_messages import NodeLink
from gpukit.launch.restarts import Progress
from gpukit.launch.signals import Signals
from gpukit.launch.workers import Worker

# A rank killed by one of these had no handler yet: a stop asked from outside (a scheduler).
_STOP_SIGNALS = (-signal.SIGTERM, -signal.SIGINT)


class WatchedSettings(Protocol):
    """What the watch reads of the job's settings (``supervisor.Settings`` has it)."""

    @property
    def folder(self) -> Path: ...
    @property
    def grace(self) -> float: ...
    @property
    def stop_timeout(self) -> float: ...
    @property
    def hang_timeout(self) -> float | None: ...
    @property
    def startup_timeout(self) -> float | None: ...
    @property
    def name(self) -> str: ...
    @property
    def out(self) -> TextIO: ...
    @property
    def env(self) -> dict[str, str]: ...
    @property
    def record(self) -> JobRecord | None: ...


class Watched(Protocol):
    """What the watch reads of the attempt (``supervisor.Attempt`` has it)."""

    @property
    def settings(self) -> WatchedSettings: ...
    @property
    def number(self) -> int: ...
    @property
    def workers(self) -> list[Worker]: ...
    @property
    def peers(self) -> Peers: ...
    @property
    def waiting(self) -> Callable[[], int] | None: ...
    @property
    def signals(self) -> Signals: ...
    def error_file(self, rank: int) -> Path: ...


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


class AttemptWatch:
    """The attempt's state between wake-ups: failures seen, deadlines, heartbeats."""

    def __init__(self, attempt: Watched, progress: Progress) -> None:
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
        # The job's view for `gpukit top` and the straggler watch (about once a second).
        # Its errors are contained (JobRecord.contained): the watch never fails the job.
        self.view: JobView | None = None
        if s.record is not None:
            visible = s.env.get("CUDA_VISIBLE_DEVICES")
            with s.record.contained(self._say):
                self.view = JobView(s.record, attempt, len(attempt.workers), visible, self._say)

    @property
    def _settings(self) -> WatchedSettings:
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
        if self.view is not None and self.hang is None:
            with self.view.record.contained(self._say):
                self.view.tick(now, self.progress)

    def _say(self, line: str) -> None:
        s = self._settings
        s.out.write(f"{s.name}: {line}\n")  # one write: a rank's output cannot land inside
        s.out.flush()

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
        try:
            write_atomic(s.folder / REPORT_FILE, f"attempt {number}\n{found.report}\n")
        except OutputWriteError as err:  # the report is said here in full all the same
            kept = f"  {err}"
        # One write, its last newline included: a rank's output cannot land inside the path.
        s.out.write(f"{found.report}\n{kept}\n")
        s.out.flush()
        fault = Fault("hung", found.rank, found.where, found.step, found.text, number)
        if s.record is not None:
            hang = {"kind": "hang", "rank": found.rank, "node": found.node, "step": found.step}
            with s.record.contained(self._say):
                s.record.event({**hang, "text": found.text, "report": found.report}, number)
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
        if self.view is not None:
            with self.view.record.contained(self._say):
                self.view.close()
        ends = [self._end(w) for w in self.attempt.workers]
        stopped_at = max((w.ended_ns or 0) for w in self.attempt.workers) / 1e9
        progress, number = self.progress, self.attempt.number
        if self.hang is not None:
            fault, seen = self.hang
            return Outcome("hung", ends, progress, fault, seen, stopped_at)
        failed = failures(ends)  # the first failure first (a rank that diverged, if one did)
        # Asked to stop, ranks that only lost a peer on the way out did not fail the job. A
        # rank a stop signal from outside ended before it had a handler (start-up, loading)
        # leaves its peers failing in whatever they were doing, not always in words that name
        # a lost peer: a stop that came from outside is still a stop, never a crash to restart.
        killed_by_stop = any(e.code in _STOP_SIGNALS and not e.asked_to_stop for e in ends)
        stop_only = self.stopping and (killed_by_stop or all(e.consequence for e in failed))
        if failed and not self.attempt.signals.received and not stop_only:
            first = failed[0]
            fault = first.fault(number, ends)
            return Outcome("failed", ends, progress, fault, first.failed_at_ns / 1e9, stopped_at)
        if self.attempt.signals.received or any(e.preempted for e in ends):
            said = _resume_hint(ends, self.attempt.signals.received)
            return Outcome("preempted", ends, progress, preempted_message=said)
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


def _resume_hint(ends: list[RankEnd], received: list[int]) -> str | None:
    """What a rank that stopped on request said (gpukit's Preempted: where it saved and how to
    resume), rank 0's first. The launcher passes any stop signal on to the ranks as SIGTERM
    (a rank without a handler then ends as a preempted one, never with a KeyboardInterrupt),
    so when the launcher itself received another signal (a Ctrl-C: SIGINT), the cause is
    said as the signal the launcher received, not the SIGTERM it sent."""
    for end in sorted(ends, key=lambda e: e.rank):
        error: ErrorRecord | None = end.error
        if error is not None and error.message.startswith("Preempted"):
            said = first_line(error.message, width=1000).removeprefix("Preempted: ")
            cause, sep, rest = said.partition(": ")
            if received and received[0] != signal.SIGTERM and cause.startswith("SIGTERM "):
                name = signal.Signals(received[0]).name
                return f"{name} received by the launcher{sep}{rest}"
            return said
    return None
