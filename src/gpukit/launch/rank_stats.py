"""Each rank's figures, as the launcher derives them from two reads of its heartbeat.

A rank's beat carries running totals (the seconds spent in each phase so far, its step); the
launcher reads it about once a second and takes the difference to the previous read that was
a step behind: a *window* of whole steps. A window begins at a read of a rank in its steps, not
at one still starting (``start``, ``setup``, ``load``): the seconds a rank took to start are
not its steps'. Per step of that window:

- ``own_s``: the rank's own work, the window's seconds less those spent where ranks meet
  (``backward``, ``collective``): data, forward, optimizer, the user's code. The rank the
  others wait for has the largest, and the others' waiting shows in their meeting phases.
- ``phases_s``: the seconds in each of ``data``, ``forward``, ``optimizer``, ``loop``, which
  name where a slow rank loses its time.

``step_s_median`` is the median seconds per step over the last :data:`WINDOWS` windows (a
steady figure a straggler is judged on), ``step_s`` the last step's length the rank wrote.
Shares of a step (data, waiting for the others, compute) need every rank's ``own_s``:
:func:`add_shares`.

>>> import tempfile
>>> from gpukit.launch.heartbeat import Heartbeat, read
>>> folder = tempfile.mkdtemp()
>>> beats, stats = Heartbeat(folder, rank=0), RankStats(0)
>>> beats.beat("loop", 3); stats.observe(read(folder, 0)); stats.window is None
True
>>> beats.beat("loop", 5); stats.observe(read(folder, 0)); stats.window.steps
2
"""

from __future__ import annotations

import contextlib
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpukit.launch.heartbeat import PHASES, Beat

WINDOWS = 20  # windows the median seconds per step is taken over
# Where ranks meet: time there is (mostly) waiting for the slowest, not a rank's own work.
WAITING_PHASES = ("backward", "collective")
# Where a rank's own time goes, the phases a straggler's excess is named by.
OWN_PHASES = ("data", "forward", "optimizer", "loop")
# A rank still starting: a read in one of these begins no window.
STARTING_PHASES = frozenset({"start", "setup", "load"})


@dataclass(frozen=True)
class Window:
    """The steps between two reads of a rank's beat, per step."""

    steps: int
    seconds: float  # the window's length
    own_s: float  # per step, outside the phases where ranks meet
    phases_s: dict[str, float]  # per step, in each of OWN_PHASES

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps


class RankStats:
    """One rank's windows, fed every read of its beat (``observe``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.beat: Beat | None = None  # the newest read
        self.window: Window | None = None  # the newest whole window
        self._base: Beat | None = None  # where the window being read began
        self._per_step: deque[float] = deque(maxlen=WINDOWS)

    def observe(self, beat: Beat) -> None:
        """Take a new read of the rank's beat; a window closes when the step moved."""
        base = self.beat
        if base is not None and (beat.attempt != base.attempt or beat.step < base.step):
            self.reset()  # a new attempt (or a rank that went back to a checkpoint)
        self.beat = beat
        if self._base is None or not beat.spent or self._base.phase in STARTING_PHASES:
            self._base = beat
            return
        steps = beat.step - self._base.step
        seconds = beat.time - self._base.time
        if steps < 1 or seconds <= 0:
            return
        spent = [now - before for now, before in zip(beat.spent, self._base.spent, strict=True)]
        waiting = sum(spent[PHASES.index(p)] for p in WAITING_PHASES)
        self.window = Window(
            steps,
            seconds,
            max(seconds - waiting, 0.0) / steps,
            {p: spent[PHASES.index(p)] / steps for p in OWN_PHASES},
        )
        self._per_step.append(self.window.step_s)
        self._base = beat

    def reset(self) -> None:
        self.beat = self.window = self._base = None
        self._per_step.clear()

    @property
    def step_s_median(self) -> float | None:
        return statistics.median(self._per_step) if self._per_step else None

    def samples_per_s(self) -> float | None:
        median = self.step_s_median
        if self.beat is None or self.beat.samples_per_step <= 0 or not median:
            return None
        return self.beat.samples_per_step / median


def add_shares(ranks: list[dict[str, Any]]) -> None:
    """Fill each RANK's ``shares`` of its step (None without a window): ``data`` (fetching
    batches), ``coll`` (waiting for the others: the slowest rank's own time less this rank's,
    at most the step) and ``compute`` (the rest). ``ranks``: every rank of the job.

    >>> ranks = [{"own_s": 0.05, "window_s": 0.1, "phases_s": {"data": 0.01}},
    ...          {"own_s": 0.08, "window_s": 0.1, "phases_s": {"data": 0.0}}]
    >>> add_shares(ranks); ranks[0]["shares"]
    {'data': 0.1, 'coll': 0.3, 'compute': 0.6}
    """
    slowest = max((r["own_s"] for r in ranks if r.get("own_s") is not None), default=0.0)
    for rank in ranks:
        step, own = rank.get("window_s"), rank.get("own_s")
        if not step or own is None:
            rank["shares"] = None
            continue
        data = min(rank["phases_s"].get("data", 0.0) / step, 1.0)
        coll = min(max(slowest - own, 0.0) / step, 1.0 - data)
        rank["shares"] = {
            "data": round(data, 4),
            "coll": round(coll, 4),
            "compute": round(max(1.0 - data - coll, 0.0), 4),
        }


def rss(pid: int) -> int | None:
    """The resident memory of process ``pid`` in bytes (``/proc``), None where unknown: the
    launcher reads it, so the rank makes no system call for it."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status", "rb") as status:
        for line in status:
            if line.startswith(b"VmRSS:"):
                return int(line.split()[1]) * 1024
    return None


def memory(beat: Beat | None, pid: int | None) -> dict[str, Any]:
    """A RANK's ``memory``: the device's bytes from the beat (None on a CPU or unknown), and
    the process's resident bytes."""
    device = beat.memory if beat is not None else (-1, -1, -1)
    allocated, peak, reserved = (value if value >= 0 else None for value in device)
    return {
        "allocated": allocated,
        "peak": peak,
        "reserved": reserved,
        "rss": rss(pid) if pid is not None else None,
    }
