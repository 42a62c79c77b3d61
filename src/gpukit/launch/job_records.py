"""What a job's launcher records for the people and tools that watch it, over every attempt.

In the job's folder (``JOB``): ``events.jsonl``, one EVENT a line (stragglers and their
recovery, restarts with their cause, a hang with its report, a node lost, the end with its
exit code), and ``events.count``, an 8-byte int64 the launcher maps and bumps after each line,
made before any rank starts: a rank that maps it too (rank 0's Runtime, for its loggers)
compares a number in memory instead of reading a file. ``live.json`` is written by ``job_view``.

With a record folder (``gpukit train --out OUT``): ``OUT/job`` (the job folder's path, which
``gpukit top --out OUT`` follows), ``OUT/events.jsonl`` (the same events) and
``OUT/ranks.jsonl`` (samples of every rank's figures, appended by node 0 at an interval that
grows with the run: ``clamp(elapsed / 200, 1 s, 30 s)``, about 200 samples a run). Each write
appends whole lines; a disk that refuses loses that record, never the job. Any other error
of the watch's own code is contained too (:meth:`JobRecord.contained`): said once for the job,
in one line, and the job runs on as it would without a watch.

>>> import tempfile
>>> from pathlib import Path
>>> record = JobRecord(Path(tempfile.mkdtemp()), "gpukit launch", ["x.py"])
>>> record.event({"kind": "restart", "text": "restart 1/3 after ..."}, attempt=0)
>>> record.count, (record.folder / "events.jsonl").read_text().count("\\n")
(1, 1)
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gpukit._util.files import append, write_atomic
from gpukit.launch.stragglers import DEFAULT_FACTOR, DEFAULT_STEPS

EVENTS_FILE = "events.jsonl"
COUNT_FILE = "events.count"
LIVE_FILE = "live.json"
RANKS_FILE = "ranks.jsonl"
JOB_FILE = "job"
KEPT_EVENTS = 20  # the newest events live.json shows


def sample_every(elapsed: float) -> float:
    """Seconds between two samples of OUT/ranks.jsonl, ``elapsed`` seconds into the job.

    >>> sample_every(10), sample_every(1000), sample_every(10**5)
    (1.0, 5.0, 30.0)
    """
    return min(max(elapsed / 200, 1.0), 30.0)


class JobRecord:
    """The job's records (see the module docstring); one per ``run_job``."""

    def __init__(
        self,
        folder: Path,
        name: str,
        command: list[str],
        out: Path | None = None,
        total_steps: int | None = None,
        straggler_factor: float = DEFAULT_FACTOR,
        straggler_steps: int = DEFAULT_STEPS,
    ) -> None:
        self.folder = folder
        self.name = name
        self.command = command
        self.out = out
        self.total_steps = total_steps
        self.straggler_factor = straggler_factor
        self.straggler_steps = straggler_steps
        self.host = socket.gethostname()
        self.started = time.time()
        self.node = 0  # this node's place, told at each attempt
        self.attempt = 0
        self.restarts = 0
        self.checkpoint = -1  # the job's newest checkpoint every rank took part in
        self.events: deque[dict[str, Any]] = deque(maxlen=KEPT_EVENTS)
        # The lines already there (a job folder given again): the counter counts every line.
        self.count = _lines(folder / EVENTS_FILE)
        self.ended: dict[str, Any] | None = None
        self.live: dict[str, Any] | None = None  # the newest live.json written
        self._sampled_at = 0.0
        self.failed = False  # the watch's own code raised: said once, never again
        self._count_map = _count_map(folder / COUNT_FILE)
        if self._count_map is not None:
            struct.pack_into("<q", self._count_map, 0, self.count)

    @contextlib.contextmanager
    def contained(self, say: Callable[[str], None]) -> Iterator[None]:
        """Around the watch's work (the view, the records): an error in it never reaches the
        job, which runs the same without its watch; the first is said, in one line through
        ``say``, and no later one (the view tries again at its next refresh)."""
        try:
            yield
        except Exception as err:
            if not self.failed:
                self.failed = True
                said = str(err).splitlines()[0] if str(err).strip() else ""
                # An output that refuses the line too (a closed pipe) is no reason to stop.
                with contextlib.suppress(Exception):
                    say(
                        f"the job's watch (live.json for gpukit top, stragglers, its records) "
                        f"failed: {type(err).__name__}{': ' + said if said else ''}; the job "
                        "goes on (the watch tries again at its next refresh; later failures "
                        "are not said)"
                    )

    def attempt_begins(self, node: int, attempt: int) -> None:
        """This node's place in attempt ``attempt``, about to start; node 0 tells
        ``OUT/job``."""
        self.node, self.attempt = node, attempt
        if self.out is not None and node == 0:
            with contextlib.suppress(OSError):
                write_atomic(self.out / JOB_FILE, f"{self.folder}\n")

    def event(self, event: dict[str, Any], attempt: int) -> None:
        """Record ``event`` (its time, attempt, node and host filled where missing)."""
        full = {
            "time": time.time(),
            "attempt": attempt,
            "step": None,
            "rank": None,
            "node": self.node,
            "host": self.host,
            **event,
        }
        self.events.append(full)
        line = json.dumps(full) + "\n"
        if self.out is not None and self.node == 0:
            with contextlib.suppress(OSError):
                append(self.out / EVENTS_FILE, line)
        try:
            append(self.folder / EVENTS_FILE, line, option="TMPDIR")
        except OSError:
            return  # the line is lost: the counter counts only the lines there
        self.count += 1
        if self._count_map is not None:
            struct.pack_into("<q", self._count_map, 0, self.count)

    def sample(self, now: float, attempt: int, ranks: list[dict[str, Any]]) -> None:
        """Append the ranks' figures to ``OUT/ranks.jsonl`` when the interval has passed
        (node 0 only)."""
        if self.out is None or self.node != 0:
            return
        if now - self._sampled_at < sample_every(now - self.started):
            return
        self._sampled_at = now
        kept = [{k: v for k, v in r.items() if k not in ("where", "gpu_note")} for r in ranks]
        line = json.dumps({"time": now, "attempt": attempt, "ranks": kept}) + "\n"
        with contextlib.suppress(OSError):
            append(self.out / RANKS_FILE, line)

    def write_live(self, live: dict[str, Any]) -> None:
        """Replace ``JOB/live.json`` with ``live`` (whole: a reader never sees half)."""
        self.live = live
        with contextlib.suppress(OSError):
            write_atomic(self.folder / LIVE_FILE, json.dumps(live) + "\n", option="TMPDIR")

    def end(self, code: int, how: str, attempt: int) -> None:
        """The job ended with exit ``code`` (``how``: finished, failed, stopped, hung)."""
        now = time.time()
        self.ended = {"time": now, "code": code, "how": how}
        self.event({"kind": "ended", "text": f"the job {how} (exit {code})", "code": code}, attempt)
        if self.live is not None:
            self.write_live(
                {
                    **self.live,
                    "ended": self.ended,
                    "updated": now,
                    "stragglers": [],
                    "events": list(self.events),
                    "restarts": self.restarts,
                }
            )
        if self._count_map is not None:
            with contextlib.suppress(ValueError):
                self._count_map.close()
            self._count_map = None


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as lines:
            return sum(1 for _ in lines)
    except OSError:
        return 0


def _count_map(path: Path) -> mmap.mmap | None:
    """The mapped counter file (None when the folder refuses it: the events still go to the
    lines, the loggers just do not hear of them)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, 8)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, 8)  # a full disk refused here, not as a SIGBUS later
        return mmap.mmap(fd, 8)
    except OSError:
        return None
    finally:
        os.close(fd)
