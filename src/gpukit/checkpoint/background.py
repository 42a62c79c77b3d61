"""The one checkpoint write a rank has in flight, on a thread of its own (``async_save``).

The save's collective part ran in the foreground (see ``writer``); what is left for the thread
is rank 0's files: write them from host copies, fsync, write the manifest, rename the folder
into place, point ``latest`` and prune, as a synchronous save does. Under fsdp every rank has a
thread, which writes its shards first (see ``sharded_behind``). A write the disk refuses
is noted as the synchronous path notes it, and the folder it began is removed; the error
reaches every rank at the next point where they all are (the next save, a load, the end of the
run): :meth:`Background.settle` waits for the thread there, the ranks agree, and each raises
the same :class:`~gpukit.errors.CheckpointWriteError` a synchronous save raises.

A crash or a kill while the thread writes costs nothing but this checkpoint: it lives in
``.tmp-step-N/`` until its rename, and ``latest`` keeps naming the previous one. A step counts
as saved once its write has ended: the thread says so (``landed``), and :meth:`Background.settle`
tells every rank whether it did.

The host copies a write reads are kept for the next save (``buffers``, see ``snapshot``) until
:meth:`Background.free`: a checkpoint's size in host memory while saves go on.

>>> bg = Background()
>>> bg.step is None, bg.wait()
(True, 0.0)
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpukit._util import placement
from gpukit.checkpoint import files
from gpukit.checkpoint.failure import Failures, clean_up, raise_agreed
from gpukit.checkpoint.snapshot import HostBuffers

_POLL_S = 0.05  # how often a wait looks again at its deadline (a stop may set one meanwhile)
# A wait this long or longer is said: a save that waited for the one before is a slower save
# (the interval is shorter than a write); shorter waits (a prune finishing) are not news.
_SAID_S = 0.1


class Background:
    """One rank's checkpoint write in flight, if any, and its outcome until the ranks agree
    on it. Rank 0 starts one (under fsdp every rank does); every rank calls :meth:`settle`.
    ``landed`` is told, on the thread, the step of each write that ended without failing
    (attributes only: the main thread may be anywhere)."""

    def __init__(self, landed: Callable[[int], None] = lambda step: None) -> None:
        self._landed = landed
        self.buffers = HostBuffers()  # the last write's host copies, for the next save
        self._writer: _Writer | None = None
        self._done: threading.Event | None = None  # set when the write in flight has ended
        self._last: threading.Event | None = None  # the same for the last write started
        self.step: int | None = None  # the step being written, until it is settled
        self._failures = Failures()
        self._directory = Path()
        self._needed = 0
        self._registered = False
        self._abandoned = False  # a stop gave up waiting for it: the exit does not wait
        # Some rank gave up a write at a settle (the ranks agreed on it there): its thread may
        # still run, under fsdp inside a collective of the background group, where a second
        # write's collectives would be matched with its own. The run's saves are then written
        # in the save (a stop's is anyway, and the run ends with it).
        self.gave_up = False

    def start(
        self,
        write: Callable[[], bool | None],
        *,
        step: int,
        directory: Path,
        tmp: Path | None,
        failures: Failures,
        needed: int,
    ) -> None:
        """Run ``write`` on a thread; a write failure is noted in ``failures`` (whose folder
        lock the thread gives back when done) and what it began in ``tmp`` removed (None: the
        folder is another rank's to remove, rank 0's under fsdp). ``write`` returns False when
        its own part went well but the checkpoint was not published (another rank's part
        failed, which that rank raises at the settle): the step has not landed."""
        assert self._done is None, "a checkpoint write is already in flight"
        self.step, self._failures, self._directory, self._needed = (
            step,
            failures,
            directory,
            needed,
        )

        def run() -> None:
            try:
                published: bool | None = False
                with failures.noted():
                    published = write()
                if failures.error is None and published is not False:
                    self._landed(step)
            except BaseException as err:  # a bug, not the disk: still reported at settle
                failures.error = err
            finally:
                if failures.error is not None and not failures.busy and tmp is not None:
                    clean_up(directory, tmp)
                failures.release()

        given_up = self._last is not None and not self._last.is_set()
        if self._writer is None or given_up or not self._writer.alive:
            # The first write; or the last one was given up and may still be writing (the
            # old thread ends once it does); or a fork left the thread behind: a new thread.
            if self._writer is not None:
                self._writer.stop()
            self._writer = _Writer()
        if not self._registered:
            atexit.register(self._at_exit)
            self._registered = True
        self._done = self._last = self._writer.run(run)

    def wait(self, deadline: Callable[[], float | None] = lambda: None) -> float:
        """Wait for the write in flight, until it ends or the time ``deadline`` gives (on
        ``time.monotonic``'s clock, asked again as the wait goes on; None: no limit); returns
        the seconds waited. Local to this rank: no collective."""
        if not self.writing:
            return 0.0
        began = time.monotonic()
        while self.writing:
            limit = deadline()
            if limit is not None and time.monotonic() >= limit:
                break
            assert self._done is not None
            self._done.wait(_POLL_S)
        return time.monotonic() - began

    @property
    def writing(self) -> bool:
        """A write is still under way on the thread."""
        return self._done is not None and not self._done.is_set()

    def settle(
        self,
        strategy: Any,
        say: Callable[[str], None],
        why: str,
        deadline: Callable[[], float | None] = lambda: None,
    ) -> bool:
        """Collective: every rank calls it where they all are (``why``: the next save, a load,
        the end). Each rank waits for its write (until ``deadline``, see :meth:`wait`: once a
        stop was asked for), saying how long when it had to wait; then the ranks agree, and
        when the write failed each raises the same CheckpointWriteError. Returns, on every
        rank, whether rank 0's write landed (False: none was in flight, or it was given up)."""
        step, failures = self.step, self._failures
        landed = step is not None
        gave_up = False
        if step is not None and self.writing:
            waited = self.wait(deadline)
            if self.writing:  # past the grace: this one is lost, the previous one stays
                self._abandoned = gave_up = True
                landed = False
                failures = Failures()
                say(
                    f"gpukit: {why}: the checkpoint of step {step} was still being written "
                    f"after {waited:.1f} s and is not saved; '{files.LATEST}' still names "
                    "the previous checkpoint"
                )
            elif waited >= _SAID_S:
                say(f"gpukit: {why} waited {waited:.1f} s for the checkpoint of step {step}")
        self._done, self.step, self._failures = None, None, Failures()
        # Only rank 0 publishes: the others learn from it whether the step is saved.
        said = strategy.all_gather_object((landed, gave_up))
        self.gave_up = self.gave_up or any(given for _, given in said)
        found = failures.agree(strategy)
        if found:
            raise_agreed(found, failures.error, strategy, self._directory, step or 0, self._needed)
        return bool(said[0][0])

    def free(self) -> None:
        """Let the host copies kept for the next save go, and the thread (the end of the
        run; a later save starts another)."""
        self.buffers.clear()
        if self._writer is not None:
            self._writer.stop()  # once its write, if any, ends
            self._writer = None

    def _at_exit(self) -> None:
        """The program ends without a last settle (no teardown): the write finishes, and a
        failure is said rather than lost."""
        if self._done is None or self._abandoned:
            return
        self.wait()
        if self._failures.error is not None:
            # Under fsdp every rank writes its own shards: each says its own failure, by rank.
            job = placement.launched()
            who = f"rank {job.rank}: " if job is not None and job.world_size > 1 else ""
            print(
                f"gpukit: {who}the checkpoint of step {self.step} in {self._directory} could "
                f"not be written: {self._failures.error}",
                file=sys.stderr,
                flush=True,
            )


class _Writer:
    """A thread that runs the writes handed to it, one after another. Started once: a save
    then only hands over its write, where starting a thread waits until the new thread runs
    (milliseconds on a CPU that other processes keep busy). A daemon: a stop past its grace
    period must be able to end the process; the normal end of a program waits for the write
    (see ``Background._at_exit``)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="gpukit-save", daemon=True)
        self._thread.start()

    def run(self, write: Callable[[], None]) -> threading.Event:
        """Hand ``write`` over (it must not raise); the event is set once it has run."""
        done = threading.Event()

        def job() -> None:
            try:
                write()
            finally:
                done.set()

        self._jobs.put(job)
        return done

    @property
    def alive(self) -> bool:
        """The thread runs (a forked child has none of its parent's threads)."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """End the thread once the writes handed over have run."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
