"""Stopping cleanly when asked to: SIGTERM (a scheduler preempting the job) or SIGINT (Ctrl-C).

The first signal only sets a flag; the step under way finishes on every rank, the ranks agree
on a step they all reach, save a checkpoint there and stop with :class:`~gpukit.Preempted`
(exit code 143). A second signal exits at once.

Agreeing costs nothing until a signal arrives: each step end reads one Python flag. Once a rank
has its flag it posts the step it reached in the process group's store (a key per rank, not a
collective) and, at each later step end, asks the store whether every rank has posted; when
all have, every rank stops at the largest posted step plus one. That step is never behind any
rank: under DDP every step ends in a gradient all-reduce, so when the last rank posts at its
step p, no rank can have finished step p + 1 yet (it would need the last rank's gradients), and
each rank sees all the posts at the end of step p or p + 1. Every rank must get the signal:
a scheduler signals them all and Ctrl-C reaches the whole process group; under gpukit's
launcher a rank that gets one passes it on at once to the others of its attempt (SIGUSR2, whose
process ids it reads from their heartbeats), and the launcher does too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from gpukit.runtime.heartbeat import Heartbeat

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Another rank was asked to stop: the same request, passed on (never a "second signal").
_PEER_SIGNAL = signal.SIGUSR2


_LEAVE_SECONDS = 30  # at most this long waiting for the other ranks to leave together


class Preemption:
    """Catches SIGTERM and SIGINT for a Runtime that has somewhere to save (see the module
    docstring). ``store`` gives the process group's store (None for one rank)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Callable[[], Any],
        heartbeat: Heartbeat | None,
        attempt: int = 0,
        peers: Callable[[], list[int]] = list,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._store = store
        self._heartbeat = heartbeat
        self._peers = peers  # the process ids of the other ranks of this attempt
        self._prefix = f"gpukit/preempt/{attempt}/"
        self.requested: str | None = None  # the signal's name once one arrived
        self.stop_at: int | None = None
        self._posted = False
        self._previous: dict[int, Any] = {}
        self.installed = False

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (only from the main thread, where Python runs signal
        handlers); ``uninstall`` puts the previous handlers back."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[_PEER_SIGNAL] = signal.signal(_PEER_SIGNAL, self._on_peer)
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        self.installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.requested is not None:  # the second signal: no more waiting
            os._exit(128 + signum)
        self.requested = signal.Signals(signum).name
        if self._heartbeat is not None:
            self._heartbeat.request_stop()
        for pid in self._peers():
            with contextlib.suppress(OSError):  # gone already: it stops anyway
                os.kill(pid, _PEER_SIGNAL)

    def _on_peer(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested = "SIGTERM (passed on from another rank)"
            if self._heartbeat is not None:
                self._heartbeat.request_stop()

    def should_stop(self, step: int) -> bool:
        """At the end of optimizer step ``step``: whether to save and stop now. One flag read
        per step until a signal arrives; then a store lookup per step until the ranks agree."""
        if self.requested is None:
            return False
        if self.world_size == 1:
            return True
        if self.stop_at is None:
            self._agree(step)
        return self.stop_at is not None and step >= self.stop_at

    def _agree(self, step: int) -> None:
        store = self._store()
        if not self._posted:
            store.set(f"{self._prefix}{self.rank}", str(step))
            self._posted = True
        keys = [f"{self._prefix}{r}" for r in range(self.world_size)]
        if store.check(keys):
            self.stop_at = max(int(store.get(k)) for k in keys) + 1

    def leave_together(self) -> None:
        """After the stop's save, before the ranks exit: rank 0 says it has left every
        collective, the others answer and only then exit, and rank 0 exits once all have
        answered. A rank that left the save's last collective and exited at once could reset
        its sockets while a slower peer still read its last message there, turning a clean
        stop into a "connection reset" on that peer. Bounded: a rank that is gone by then
        only shortens the wait."""
        if self.world_size == 1:
            return
        store = self._store()
        done, ack = f"{self._prefix}left/0", f"{self._prefix}answered/"
        with contextlib.suppress(Exception):  # the stop goes on whatever the store says
            previous = store.timeout
            store.set_timeout(datetime.timedelta(seconds=_LEAVE_SECONDS))
            try:
                if self.rank == 0:
                    store.set(done, "1")
                    store.wait([f"{ack}{r}" for r in range(1, self.world_size)])
                else:
                    store.wait([done])
                    store.set(f"{ack}{self.rank}", "1")
            finally:
                store.set_timeout(previous)
