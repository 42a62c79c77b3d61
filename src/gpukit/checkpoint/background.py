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
``.tmp-step-N/`` until its rename, and ``latest`` keeps naming the previous one.

>>> bg = Background()
>>> bg.step is None, bg.wait()
(True, 0.0)
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpukit.checkpoint import files
from gpukit.checkpoint.failure import Failures, clean_up, raise_agreed

_POLL_S = 0.05  # how often a wait looks again at its deadline (a stop may set one meanwhile)
# A wait this long or longer is said: a save that waited for the one before is a slower save
# (the interval is shorter than a write); shorter waits (a prune finishing) are not news.
_SAID_S = 0.1


class Background:
    """One rank's checkpoint write in flight, if any, and its outcome until the ranks agree
    on it. Rank 0 starts one (under fsdp every rank does); every rank calls :meth:`settle`."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.step: int | None = None  # the step being written, until it is settled
        self._failures = Failures()
        self._directory = Path()
        self._needed = 0
        self._registered = False
        self._abandoned = False  # a stop gave up waiting for it: the exit does not wait

    def start(
        self,
        write: Callable[[], None],
        *,
        step: int,
        directory: Path,
        tmp: Path | None,
        failures: Failures,
        needed: int,
    ) -> None:
        """Run ``write`` on a thread; a write failure is noted in ``failures`` (whose folder
        lock the thread gives back when done) and what it began in ``tmp`` removed (None: the
        folder is another rank's to remove, rank 0's under fsdp)."""
        assert self._thread is None, "a checkpoint write is already in flight"
        self.step, self._failures, self._directory, self._needed = (
            step,
            failures,
            directory,
            needed,
        )

        def run() -> None:
            try:
                with failures.noted():
                    write()
            except BaseException as err:  # a bug, not the disk: still reported at settle
                failures.error = err
            finally:
                if failures.error is not None and not failures.busy and tmp is not None:
                    clean_up(directory, tmp)
                failures.release()

        # A daemon: a stop past its grace period must be able to end the process; the normal
        # end of a program waits for it (see _at_exit).
        self._thread = threading.Thread(target=run, name=f"gpukit-save-{step}", daemon=True)
        if not self._registered:
            atexit.register(self._at_exit)
            self._registered = True
        self._thread.start()

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
            assert self._thread is not None
            self._thread.join(_POLL_S)
        return time.monotonic() - began

    @property
    def writing(self) -> bool:
        """A write is still under way on the thread."""
        return self._thread is not None and self._thread.is_alive()

    def settle(
        self,
        strategy: Any,
        say: Callable[[str], None],
        why: str,
        deadline: Callable[[], float | None] = lambda: None,
    ) -> None:
        """Collective: every rank calls it where they all are (``why``: the next save, a load,
        the end). Each rank waits for its write (until ``deadline``, see :meth:`wait`: once a
        stop was asked for), saying how long when it had to wait; then the ranks agree, and
        when the write failed each raises the same CheckpointWriteError."""
        step, failures = self.step, self._failures
        if step is not None and self.writing:
            waited = self.wait(deadline)
            if self.writing:  # past the grace: this one is lost, the previous one stays
                self._abandoned = True
                failures = Failures()
                say(
                    f"gpukit: {why}: the checkpoint of step {step} was still being written "
                    f"after {waited:.1f} s and is not saved; '{files.LATEST}' still names "
                    "the previous checkpoint"
                )
            elif waited >= _SAID_S:
                say(f"gpukit: {why} waited {waited:.1f} s for the checkpoint of step {step}")
        self._thread, self.step, self._failures = None, None, Failures()
        found = failures.agree(strategy)
        if found:
            raise_agreed(found, failures.error, strategy, self._directory, step or 0, self._needed)

    def _at_exit(self) -> None:
        """The program ends without a last settle (no teardown): the write finishes, and a
        failure is said rather than lost."""
        if self._thread is None or self._abandoned:
            return
        self.wait()
        if self._failures.error is not None:
            print(
                f"gpukit: the checkpoint of step {self.step} in {self._directory} could not be "
                f"written: {self._failures.error}",
                file=sys.stderr,
                flush=True,
            )
