"""Each rank's heartbeat: where it is, written to shared memory at the phase boundaries the
Runtime owns, read from outside the ranks by gpukit's launcher to tell a hang from slow work.

A beat is a few bytes written into a memory-mapped file (``GPUKIT_JOB_DIR/beat-<rank>``): no
system call, no collective, no device synchronisation; 2-3 µs with the walk up to the caller's
line. The launcher (``gpukit.launch``) reads every rank's file; a rank whose last beat is
older than the hang timeout is stuck, and the one furthest behind (step, then phase) is the one
to blame.

The same record carries what ``gpukit top`` and the launcher's straggler watch read: the
seconds spent in each phase so far (added up at each beat from the clock read the beat takes
anyway), the last step's end and length, the samples a step takes, and, on a GPU, the
allocator's counters (read at a step's end at most once a second; no device synchronisation).

Without ``GPUKIT_JOB_DIR`` (no gpukit launcher watching) a beat does nothing.

Each record is written under a sequence number (odd while a write is under way), so a reader
never takes half of one write for a whole record.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> beats = Heartbeat(folder, rank=1)
>>> beats.beat("backward", 5)
>>> record = read(folder, 1)
>>> record.rank, record.step, record.phase, record.saved_step
(1, 5, 'backward', -1)
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gpukit import _env
from gpukit._util import placement
from gpukit._util.files import write_error

# The phases in the order a step goes through them: the rank furthest behind is the one the
# others wait for. "loop" is the user's code between steps (the forward, data loading).
PHASES: tuple[str, ...] = (
    "start",  # the Runtime exists; the process group is being joined
    "setup",
    "load",
    "loop",
    "data",  # a set-up loader fetches the next batch
    "forward",  # from the batch handed (or the first backward) to the backward
    "backward",
    "optimizer",
    "collective",  # rt.barrier, rt.all_reduce, rt.all_gather, rt.broadcast
    "save",
    "end",
)
_PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}
MEMORY_EVERY_S = 1.0  # the device's memory is read at a step's end at most this often
# The phases where ranks may meet in a collective, once per Runtime call that enters them:
# ranks in step make as many of these calls, so a rank standing in another call than its
# peers at the same count has left their sequence (gpukit.launch.failures.diverged).
_MEETS = frozenset({"setup", "load", "backward", "optimizer", "collective", "save"})
MEETING_PHASES = _MEETS  # for readers of the beats (the launcher)

# seq, time, step, saved step, pid, phase, stop requested (preemption), attempt, calls, where;
# then what a watcher needs for its figures: the seconds spent in each phase so far, the last
# step's end and length, the samples a step takes, the device's memory and which device.
_WHERE_BYTES = 120
# Native byte order (writer and readers share the machine), standard sizes, no padding: every
# 8-byte field lies at a multiple of 8, so a beat writes its fields through typed views of the
# map, each a plain store, instead of packing (a beat runs at every boundary of every step).
_HEAD = struct.Struct("=QdqqiiiIQ")
_WHERE = struct.Struct(f"={_WHERE_BYTES}s")
_SECONDS = struct.Struct("=d")  # one phase's seconds
_TAIL = struct.Struct("=ddqqqqi")  # the last step's end and length, samples, memory, device
# (padded to whole 8-byte items, for the views)
_FORMAT = f"{_HEAD.format}{_WHERE_BYTES}s{len(PHASES)}d{_TAIL.format[1:]}4x"
# Where each part lies in the record: a beat rewrites only the parts that changed.
_WHERE_AT = _HEAD.size
_SPENT_AT = _WHERE_AT + _WHERE_BYTES
_TAIL_AT = _SPENT_AT + len(PHASES) * _SECONDS.size
_SEQ = struct.Struct("=Q")
# The fields a beat writes, as indexes into the map seen as 8-byte or 4-byte items.
_Q_SEQ, _D_TIME, _Q_STEP, _Q_SAVED, _I_PHASE, _Q_CALLS = 0, 1, 2, 3, 9, 6
_D_SPENT = _SPENT_AT // 8
assert _HEAD.size == 56 and _SPENT_AT % 8 == 0 and _TAIL_AT % 8 == 0
_SIZE = struct.calcsize(_FORMAT)
# Where a beat comes from: the Runtime's own modules (the step, the run's boundaries, the
# checkpoints) are skipped to reach the caller's line.
_PACKAGE = Path(__file__).resolve().parents[1]
_RUNTIME_DIRS = tuple(
    str(_PACKAGE / room) + os.sep for room in ("runtime", "lifecycle", "checkpoint")
)


@dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat."""

    rank: int
    time: float  # time.time() of the beat
    step: int  # optimizer steps taken
    saved_step: int  # the step of the last checkpoint this rank took part in, -1: none
    pid: int
    phase: str
    stop_requested: bool  # the rank got SIGTERM/SIGINT and will save and stop
    attempt: int
    calls: int = 0  # calls where ranks meet (backward, step, collectives, saves) so far
    where: str = ""  # "rt.all_reduce at train.py:20": the call and the line that made it
    spent: tuple[float, ...] = ()  # seconds spent in each phase so far, indexed like PHASES
    step_ended_at: float = 0.0  # time.time() of the last step's end, 0: none yet
    last_step_s: float = 0.0  # seconds between the last two step ends, 0: fewer than two
    samples_per_step: int = 0  # samples one optimizer step takes on this rank, 0: unknown
    memory: tuple[int, int, int] = (-1, -1, -1)  # device bytes allocated, peak, reserved; -1
    device: int = -1  # the CUDA device's index in the rank's own numbering, -1: not a GPU

    def spent_in(self, phase: str) -> float:
        """Seconds this rank has spent in ``phase`` so far (0 for a record without them)."""
        index = _PHASE_INDEX[phase]
        return self.spent[index] if index < len(self.spent) else 0.0

    @property
    def progress(self) -> tuple[int, int]:
        """Sort key: further in the run is larger (step, then phase within it)."""
        return (self.step, _PHASE_INDEX.get(self.phase, 0))


class Heartbeat:
    """The writing end, one per rank (see the module docstring)."""

    def __init__(self, folder: str | Path, rank: int, attempt: int = 0) -> None:
        path = Path(folder) / f"beat-{rank}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, _SIZE)
                if hasattr(os, "posix_fallocate"):
                    # The blocks taken now: a full disk is refused here, as one clear error,
                    # not met by a later beat's write to the map as a SIGBUS that kills the rank.
                    os.posix_fallocate(fd, 0, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
                view = memoryview(self._map)
                self._words, self._doubles = view.cast("q"), view.cast("d")
                self._ints = view.cast("i")
            finally:
                os.close(fd)
        except OSError as err:
            where = "TMPDIR, where the launcher makes its job folder"
            raise write_error(path, err, option=where) from err
        self._seq = 0
        self._pid = os.getpid()
        self._attempt = attempt
        self.step = 0
        self.saved_step = -1
        self.stop_requested = False
        self.phase = "start"
        self.calls = 0
        self.where = b""
        # The watcher's figures: accumulated at each beat from the time.time() it takes anyway.
        self.spent = [0.0] * len(PHASES)
        self._phase_index = _PHASE_INDEX["start"]
        self._at = time.time()
        self.step_ended_at = 0.0
        self.last_step_s = 0.0
        self.samples_per_step = 0
        self.device = -1
        self.memory = (-1, -1, -1)
        # Reads the device's allocator counters (no device synchronisation): set on GPUs, and
        # called at a step's end at most once a second.
        self.memory_reader: Callable[[], tuple[int, int, int]] | None = None
        self._memory_at = 0.0

    @classmethod
    def from_env(cls) -> Heartbeat | None:
        """The heartbeat the launcher watches, or None when no gpukit launcher started us."""
        folder = _env.job_dir()
        place = placement.launched()
        if folder is None or place is None:
            return None
        return cls(folder, place.rank, _env.attempt())

    def beat(self, phase: str, step: int) -> None:
        """Record that this rank entered ``phase`` at optimizer step ``step``, now; in a call
        where ranks meet, from the Runtime call it is in and the line that made it (a walk of
        a few frames, about a microsecond: ranks that disagree on a collective are told apart
        by these). Only the parts of the record that changed are written."""
        self.phase, self.step = phase, step
        if phase in _MEETS:
            self.calls += 1
        # Only where ranks meet is the call and its line named (ranks that disagree are told
        # apart by it; the walk up the stack is half a beat's cost). The step's own boundaries
        # and a loader's fetch keep the last call's line: a rank stuck there is shown by the
        # stack the hang watch dumps.
        where = _caller(sys._getframe(1)) if phase in _MEETS else None
        now = time.time()
        previous = self._phase_index
        self.spent[previous] += now - self._at
        self._phase_index, self._at = _PHASE_INDEX[phase], now
        ended = phase == "loop"  # a step ended
        if ended:
            if self.step_ended_at:
                self.last_step_s = now - self.step_ended_at
            self.step_ended_at = now
            reader = self.memory_reader
            if reader is not None and now - self._memory_at >= MEMORY_EVERY_S:
                self._memory_at = now
                self.memory = reader()
        if not self._seq:  # the first beat writes the whole record
            if where is not None:
                self.where = where
            self._write(now)
            return
        words, doubles = self._words, self._doubles
        self._seq += 1  # odd: a write is under way
        words[_Q_SEQ] = self._seq
        doubles[_D_TIME] = now
        words[_Q_STEP] = step
        # A background save's thread sets saved_step when its write lands; the beat, the one
        # writer of the record, carries it to the launcher.
        words[_Q_SAVED] = self.saved_step
        self._ints[_I_PHASE] = self._phase_index
        words[_Q_CALLS] = self.calls
        if where is not None and where != self.where:
            self.where = where
            _WHERE.pack_into(self._map, _WHERE_AT, where)
        doubles[_D_SPENT + previous] = self.spent[previous]
        if ended:
            self._pack_tail()
        self._seq += 1  # even: the record is whole
        words[_Q_SEQ] = self._seq

    def saved(self, step: int) -> None:
        """A checkpoint at ``step`` is complete on this rank."""
        self.saved_step = step
        self._write()

    def request_stop(self) -> None:
        """This rank was asked to stop (a signal): the launcher relays it to the others."""
        self.stop_requested = True
        self._write()

    def _write(self, now: float | None = None) -> None:
        """Write the whole record (the first beat, a save, a stop request: rare)."""
        memory = self._map
        self._seq += 1  # odd: a write is under way
        _SEQ.pack_into(memory, 0, self._seq)
        self._pack_head(time.time() if now is None else now)
        _WHERE.pack_into(memory, _WHERE_AT, self.where)
        struct.pack_into(f"<{len(PHASES)}d", memory, _SPENT_AT, *self.spent)
        self._pack_tail()
        self._seq += 1  # even: the record is whole
        _SEQ.pack_into(memory, 0, self._seq)

    def _pack_head(self, now: float) -> None:
        _HEAD.pack_into(
            self._map,
            0,
            self._seq,
            now,
            self.step,
            self.saved_step,
            self._pid,
            self._phase_index,
            int(self.stop_requested),
            self._attempt,
            self.calls,
        )

    def _pack_tail(self) -> None:
        _TAIL.pack_into(
            self._map,
            _TAIL_AT,
            self.step_ended_at,
            self.last_step_s,
            self.samples_per_step,
            *self.memory,
            self.device,
        )


def read(folder: str | Path, rank: int) -> Beat | None:
    """Rank ``rank``'s last beat, or None when it has not beaten yet."""
    path = Path(folder) / f"beat-{rank}"
    try:
        data = path.read_bytes()
    except OSError:
        return None
    for _ in range(100):
        if len(data) < _SIZE:
            return None
        fields = struct.unpack_from(_FORMAT, data)
        seq, when, step, saved, pid, phase, stop, attempt, calls, where = fields[:10]
        if seq and seq % 2 == 0:
            text = where.rstrip(b"\0").decode(errors="replace")
            spent = fields[10 : 10 + len(PHASES)]
            ended, last, samples, allocated, peak, reserved, device = fields[10 + len(PHASES) :]
            return Beat(
                rank,
                when,
                step,
                saved,
                pid,
                PHASES[phase],
                bool(stop),
                attempt,
                calls,
                text,
                spent,
                ended,
                last,
                samples,
                (allocated, peak, reserved),
                device,
            )
        time.sleep(0.001)  # a write is under way: read again
        data = path.read_bytes()
    return None


# A code object's file -> whether it is the Runtime's own. Keyed by the file's name, whose hash
# Python keeps: a code object's hash is computed anew at each lookup, over its constants too
# (microseconds per frame for a large function, several frames a beat).
_IN_RUNTIME: dict[str, bool] = {}
_SAID: dict[tuple[str, int, str], bytes] = {}  # (file, line, call) -> what the record holds


def _caller(frame: FrameType | None) -> bytes:
    """``rt.backward at train.py:13``: the Runtime method the caller called, and where, as the
    record holds it (made once per call and line: the walk is most of a beat's cost)."""
    inside: FrameType | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        own = _IN_RUNTIME.get(path)
        if own is None:
            own = _IN_RUNTIME[path] = path.startswith(_RUNTIME_DIRS)
        if not own:
            break
        inside, frame = frame, frame.f_back
    if frame is None or inside is None:
        return b""
    path, line, call = frame.f_code.co_filename, frame.f_lineno, inside.f_code.co_name
    key = (path, line, call)  # strings and an int: their hashes are kept, a code object's not
    said = _SAID.get(key)
    if said is None:
        name = os.path.basename(path)
        said = _SAID[key] = f"rt.{call} at {name}:{line}".encode()[:_WHERE_BYTES]
    return said
