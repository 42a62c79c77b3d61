"""When to restart a failed job, what each restart cost, and the words for both.

A failed attempt is restarted (all ranks, a fresh port) unless:

- its failure would come again: a rank exited with code 2 (gpukit's command line on bad input
  or on a file the disk refused), or raised a gpukit error that says so (a
  ``ConfigError``, an ``OutputWriteError`` such as a ``CheckpointWriteError``: ``will_repeat``);
- the job never trained: no attempt's heartbeat step moved past where it began (a rank that
  never beat has not begun) and no checkpoint is known. An import error, a wrong path, a model
  that does not fit: restarting would fail the same way. This is the job's history, not the
  attempt's: once the job has trained, a failure at any later moment (a rank killed while a
  restart starts up, joins the process group, loads the checkpoint or saves) is restarted;
- ``repeats`` failed attempts in a row saved no new step (the job's newest checkpoint did not
  move): a crash loop, whatever each failure was;
- no restarts are left.

Each restart's line says which rule let it through (``the job has trained (checkpoint at step
40)``).

The heartbeats also tell what a restart costs: the steps since the last checkpoint, done again
(``step - saved_step``), and the time from the failure to training again, in three phases:
stopping the workers, starting processes until every rank's first beat (import, rendezvous),
and from there to the first step done (setup, loading the checkpoint).

>>> from dataclasses import replace
>>> from gpukit.launch.failures import Fault, RankEnd
>>> boom = Fault("raised", 1, "ValueError: bad", 6, "rank 1 raised ValueError: bad at step 6")
>>> crash_loop([boom, boom], repeats=3), crash_loop([boom, boom, boom], repeats=3)
(False, True)
>>> saved = [replace(boom, saved=s) for s in (4, 8, 8, 8)]  # the job's newest checkpoint
>>> no_new_save(saved, repeats=2), no_new_save(saved, repeats=3)
(True, False)
>>> redone(6, 4)
'2 step(s) since the checkpoint at step 4 are redone'
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from gpukit._util.files import append
from gpukit.launch.failures import Fault, RankEnd
from gpukit.launch.heartbeat import Beat

# Phases a rank beats in before its training loop; only "load" carries the step the attempt
# resumes from ("start" and "setup" come before the checkpoint is read).
_BEFORE_LOOP = ("start", "setup", "load")
DEFAULT_CRASH_LOOP = 3
# One line per attempt in the job's folder: the times the restart figures come from.
ATTEMPTS_FILE = "attempts.jsonl"


def crash_loop(faults: list[Fault], repeats: int = DEFAULT_CRASH_LOOP) -> bool:
    """The last ``repeats`` faults are the same failure."""
    if repeats < 1 or len(faults) < repeats:
        return False
    last = faults[-1]
    return all(f.same_as(last) for f in faults[-repeats:])


def no_new_save(faults: list[Fault], repeats: int = DEFAULT_CRASH_LOOP) -> bool:
    """The last ``repeats`` failed attempts saved no new step: the job's newest checkpoint
    after them (``Fault.saved``) is where it was before the first of them (-1 before the job's
    first attempt)."""
    if repeats < 1 or len(faults) < repeats:
        return False
    before = faults[-repeats - 1].saved if len(faults) > repeats else -1
    return all(f.saved <= before for f in faults[-repeats:])


def trained(checkpoint: int, furthest: int) -> str | None:
    """How the job has trained, in words, or None when it never has: ``checkpoint``, the
    newest checkpoint every rank took part in (-1: none); ``furthest``, the furthest step an
    attempt advanced to (-1: none did).

    >>> trained(40, 43), trained(-1, 7), trained(-1, -1)
    ('the job has trained (checkpoint at step 40)', 'the job has trained (to step 7, no \
checkpoint yet)', None)
    """
    if checkpoint >= 0:
        return f"the job has trained (checkpoint at step {checkpoint})"
    if furthest >= 0:
        return f"the job has trained (to step {furthest}, no checkpoint yet)"
    return None


def stop_reason(
    faults: list[Fault], trained: bool, restarts_done: int, max_restarts: int, repeats: int
) -> str | None:
    """Why the job must not be restarted after its latest fault; None: restart it.
    ``trained``: some attempt of the job advanced, or a checkpoint of it exists (the job's
    history, not the latest attempt's)."""
    if max_restarts == 0:
        return ""  # restarts were not asked for: nothing to explain
    if faults and faults[-1].will_repeat:
        return (
            f"{faults[-1].text} (bad input, or a write the disk refused): restarting "
            "would fail the same way"
        )
    if not trained:
        return (
            "it failed before its first step: restarting would fail the same way (no attempt "
            "of the job took a step, and it has no checkpoint)"
        )
    if faults[-1].kind == "diverged":
        return (
            "the ranks' collectives diverged, a fault of the program: a restart resumes "
            "exactly and would diverge the same way"
        )
    if no_new_save(faults, repeats):
        saved = faults[-1].saved
        newest = f"the newest is step {saved}" if saved >= 0 else "there is none"
        if crash_loop(faults, repeats):
            what = f"the same failure {repeats} times in a row (a crash loop)"
        else:
            what = f"{repeats} failed attempts in a row (a crash loop)"
        return (
            f"{what}, none of them saved a new checkpoint ({newest}): restarting would not "
            "get further"
        )
    if restarts_done >= max_restarts:
        return f"no restarts left (all {max_restarts} used)"
    return None


def redone(step: int | None, checkpoint: int) -> str:
    """The work a restart does again: the steps since the checkpoint it resumes from."""
    if step is None:
        return "the work lost is unknown (no heartbeat)"
    if checkpoint >= 0:
        lost = max(step - checkpoint, 0)
        return f"{lost} step(s) since the checkpoint at step {checkpoint} are redone"
    return f"{step} step(s) since the start are redone (no checkpoint yet)"


@dataclass
class Progress:
    """What one attempt's heartbeats showed, as they were read (every ~0.15 s, and once more
    when each rank ended: a fast rank may have taken several steps between two reads).

    Where a rank began: the step of its "load" beat when one was seen, else the step the
    attempt should resume from (another rank's "load" beat, else ``resumes_from``: the last
    checkpoint known, or 0), or 0 when the first step seen is below that (it started over)."""

    started: float  # when its processes were started (time.time())
    ranks: int
    resumes_from: int = 0
    base: dict[int, int] = field(default_factory=dict)  # the step each rank began from
    last: dict[int, Beat] = field(default_factory=dict)
    first_beat: dict[int, float] = field(default_factory=dict)
    first_step_at: float | None = None
    _loaded: set[int] = field(default_factory=set)

    def observe(self, beat: Beat) -> None:
        rank = beat.rank
        self.last[rank] = beat
        self.first_beat.setdefault(rank, beat.time)
        if beat.phase == "load":
            self.base[rank] = beat.step
            self._loaded.add(rank)
        if beat.phase in _BEFORE_LOOP:
            return
        if rank not in self.base:
            # Ranks resume from the same checkpoint: another rank's "load" beat tells it too.
            loaded = [self.base[r] for r in self._loaded]
            resumed = loaded[0] if loaded else self.resumes_from
            # Below that step, it did not resume from there: it started over, most likely.
            self.base[rank] = resumed if beat.step >= resumed else 0
        if self.first_step_at is None and beat.step > self.base[rank]:
            self.first_step_at = beat.time

    @property
    def advanced(self) -> bool:
        """Some rank completed a step in this attempt."""
        return self.first_step_at is not None

    @property
    def all_beaten_at(self) -> float | None:
        """When the last rank gave its first beat, or None while one has not."""
        if len(self.first_beat) < self.ranks:
            return None
        return max(self.first_beat.values())

    @property
    def step(self) -> int | None:
        """The furthest step any rank reached, or None without a beat."""
        return max((b.step for b in self.last.values()), default=None)

    @property
    def checkpoint(self) -> int:
        """The step of the last checkpoint every rank beat took part in (-1: none)."""
        if not self.last:
            return -1
        return min(b.saved_step for b in self.last.values())

    def startup_s(self) -> float | None:
        """Seconds from starting the processes to every rank's first beat."""
        beaten = self.all_beaten_at
        return None if beaten is None else max(beaten - self.started, 0.0)

    def resume_s(self) -> float | None:
        """Seconds from every rank's first beat to the first step done."""
        beaten = self.all_beaten_at
        if beaten is None or self.first_step_at is None:
            return None
        return max(self.first_step_at - beaten, 0.0)


def record_attempt(
    folder: Path,
    number: int,
    progress: Progress,
    ends: list[RankEnd],
    failed: float | None,
    gone: float | None,
) -> None:
    """Add attempt ``number``'s times (``time.time()`` seconds, null where unseen) to
    ``ATTEMPTS_FILE`` in the job's folder: its processes started, every rank's first beat, the
    first step done, the failure (or the hang's detection), each rank's end (and whether the
    launcher stopped it) and the last worker gone. For tools (``gpukit bench restarts``); a
    folder that refuses it costs nothing but the record."""
    line = {
        "attempt": number,
        "started": progress.started,
        "first_beats": {str(r): t for r, t in sorted(progress.first_beat.items())},
        "all_beaten": progress.all_beaten_at,
        "first_step": progress.first_step_at,
        "failed": failed,
        "ends": {str(e.rank): [e.ended_ns / 1e9, e.code, e.stopped] for e in ends},
        "gone": gone,
    }
    # A record for measuring restarts: a full disk must not fail the job for it, and a failed
    # append is cut back to whole lines, so its readers never meet half a record.
    with contextlib.suppress(OSError):
        append(folder / ATTEMPTS_FILE, json.dumps(line) + "\n")


@dataclass
class Restart:
    """One restart: after which fault, the work done again, and its time in phases."""

    number: int
    fault: Fault
    redone: str
    stop_s: float | None  # from the failure (or the hang's detection) to every worker gone
    startup_s: float | None = None  # start of the processes to every rank's first beat
    resume_s: float | None = None  # first beats to the first step done
    rule: str = ""  # why it was restarted: "the job has trained (checkpoint at step 40)"
    early: bool = False  # the failure came before the attempt's first step (start-up, load)

    def line(self, of: int) -> str:
        moment = " before the attempt's first step" if self.early else ""
        line = f"restart {self.number}/{of} after {self.fault.text}{moment}; {self.redone}"
        return f"{line}; {self.rule}: restarting" if self.rule else line

    def timing(self) -> str:
        return (
            f"restart {self.number}: stopping {_s(self.stop_s)}, starting until every rank's "
            f"first beat {_s(self.startup_s)} (import + rendezvous), then to the first step "
            f"{_s(self.resume_s)} (setup + resume)"
        )


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.1f} s"


def summary(name: str, faults: list[Fault], restarts: list[Restart], ended: str) -> list[str]:
    """The job's last words when it restarted: how it ended, its FIRST fault (not the last
    attempt's), and what each restart cost."""
    first = faults[0] if faults else None
    lines = [f"{name}: {ended} after {len(restarts)} restart(s)"]
    if first is not None:
        lines[0] += f"; the job's first fault: {first.text} (attempt {first.attempt})"
    lines += [f"  {r.timing()}; {r.redone}" for r in restarts]
    return lines
