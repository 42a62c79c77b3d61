"""What gpukit's launcher says about the job, told to rank 0's loggers: a rank named a
straggler (``{"straggler/rank": r, "straggler/slowdown": x}``) and a straggler recovered
(``{"straggler/recovered_rank": r}``), at the step of the log record that follows.

The launcher appends each event of the job to ``JOB/events.jsonl``, one JSON object a line,
and then counts it in ``JOB/events.count``: eight bytes, a little-endian int64, in a file it
makes before it starts the ranks. Rank 0 maps that counter when its Runtime starts and reads it
at each record its loggers get (every ``log_every`` steps: the flush that reads the metrics
back), a read of memory; only when the count grew does it read the new lines. Without the
counter (no gpukit launcher, or one that keeps no events) nothing is mapped and nothing read.
Events counted before the Runtime started are not told again: a restarted run's earlier
attempt told them. A line that cannot be read is skipped: the job's record must never stop
the training.

>>> import json, tempfile
>>> from pathlib import Path
>>> job = Path(tempfile.mkdtemp())
>>> (job / COUNT_FILE).write_bytes((0).to_bytes(8, "little"))
8
>>> events = JobEvents.open(job)
>>> line = {"kind": "straggler", "rank": 1, "slowdown": 2.4, "step": 40}
>>> _ = (job / EVENTS_FILE).write_text(json.dumps(line) + "\\n")
>>> _ = (job / COUNT_FILE).write_bytes((1).to_bytes(8, "little"))
>>> events.news()
[{'straggler/rank': 1, 'straggler/slowdown': 2.4}]
>>> events.news()
[]
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any

COUNT_FILE = "events.count"  # the launcher's count of the lines in EVENTS_FILE: int64, "<q"
EVENTS_FILE = "events.jsonl"
_COUNT = struct.Struct("<q")


class JobEvents:
    """Rank 0's reader of the job's events (see the module docstring): :meth:`news` gives the
    loggers' metrics of the events counted since the last call."""

    def __init__(self, folder: Path, count: mmap.mmap) -> None:
        self.folder = folder
        self._count = count
        self._seen = self._counted()  # events before the start: told by an earlier attempt
        self._offset: int | None = None  # bytes of EVENTS_FILE read, once known

    @classmethod
    def open(cls, folder: Path | None) -> JobEvents | None:
        """The job's events in ``folder`` (``GPUKIT_JOB_DIR``), or None when the launcher
        keeps no counter there (or none that can be mapped)."""
        if folder is None:
            return None
        try:
            fd = os.open(folder / COUNT_FILE, os.O_RDONLY)
        except OSError:
            return None
        try:
            count = mmap.mmap(fd, _COUNT.size, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # shorter than a counter: not the launcher's
            return None
        finally:
            os.close(fd)
        return cls(folder, count)

    def _counted(self) -> int:
        return int(_COUNT.unpack_from(self._count, 0)[0])

    def news(self) -> list[dict[str, float]]:
        """The metrics for the loggers of each straggler event counted since the last call (a
        read of memory when there is none)."""
        counted = self._counted()
        if counted <= self._seen:
            return []
        lines = self._new_lines(counted - self._seen)
        self._seen += len(lines)
        if not lines:  # counted but unreadable: not read again at every record
            self._seen = counted
        return [told for line in lines if (told := _metrics(line)) is not None]

    def _new_lines(self, wanted: int) -> list[bytes]:
        """Up to ``wanted`` whole lines after those read (the first call skips the lines
        counted before the start)."""
        path = self.folder / EVENTS_FILE
        try:
            with path.open("rb") as file:
                if self._offset is not None:
                    file.seek(self._offset)
                data = file.read()
        except OSError:
            return []
        start = 0
        if self._offset is None:  # skip the lines told before this Runtime started
            for _ in range(self._seen):
                end = data.find(b"\n", start)
                if end < 0:
                    return []
                start = end + 1
            self._offset = 0
        lines: list[bytes] = []
        while len(lines) < wanted:
            end = data.find(b"\n", start)
            if end < 0:  # a line still being written: read it next time
                break
            lines.append(data[start:end])
            start = end + 1
        self._offset += start
        return lines

    def close(self) -> None:
        self._count.close()


def _metrics(line: bytes) -> dict[str, float] | None:
    """The loggers' metrics of one event line, or None for an event they are not told (or a
    line that is not an event)."""
    try:
        event: Any = json.loads(line)
        kind, rank = event["kind"], int(event["rank"])
        if kind == "straggler":
            return {"straggler/rank": rank, "straggler/slowdown": float(event["slowdown"])}
        if kind == "straggler-recovered":
            return {"straggler/recovered_rank": rank}
    except (ValueError, TypeError, KeyError):
        return None
    return None
