"""Stopping cleanly when asked to: SIGTERM (a scheduler preempting the job) or SIGINT (Ctrl-C).

A request only sets a flag; the step under way finishes on every rank, the ranks agree on a step
they all reach, save a checkpoint there and stop with :class:`~gpukit.Preempted` (exit code 143).
The handlers are taken over at the run's first step: before it there is nothing to save, and a
signal does what it always does (SIGTERM ends the process, Ctrl-C raises KeyboardInterrupt).

**Which signals count.** However a request is delivered, it is one request: a scheduler signals
every process of the job (Slurm's ``scancel``, Kubernetes), a launcher passes the signal it got
on to its ranks (gpukit's, torchrun), a terminal's Ctrl-C reaches every process in its group.
So copies of SIGTERM never cut the save short (the scheduler's SIGKILL after its grace period
does that anyway), and neither do copies of SIGINT handled within :data:`SECOND_SIGNAL_AFTER_S`
of the first. A SIGINT later than that is the user pressing Ctrl-C again: the process exits at
once (code 130), without saving. A request that finds no step end to save at within
``GPUKIT_STOP_GRACE`` seconds (the loop is over, or stuck) ends the process with 143 then,
saying that nothing was saved (under gpukit's launcher, which keeps that deadline itself and
says it once for the job, the launcher does).

**Telling every rank.** A rank that gets a signal posts the request in the process group's
store at once and passes it on to the ranks on its machine (SIGUSR2, to the process ids each
rank posted there when it started); every rank's watcher thread also looks for a request in the
store every :data:`WATCH_S` seconds, so a signal to one rank, on any machine of the job,
reaches all of them. Before a request nothing runs on the step's path but one Python flag read
per step; the watcher's one store lookup per :data:`WATCH_S` seconds runs beside it, on its own
thread.

**Agreeing on the step.** Once a rank has the request, it posts the step it reached (a store
``add``, which returns only once the store holds it) and, at each later step end, asks the
store whether every rank has posted; when all have, every rank stops at the largest posted step
plus one. That step is never behind any rank: under DDP and fsdp every step ends in a gradient
collective, so when the last rank posts at its step p, no rank can have finished step p + 1 (it
would need the last rank's gradients), and each rank sees every post at the end of step p or
p + 1.

**Never restarted.** A stop on request is not a failure: gpukit's launcher exits 143 without
restarting. Under torchrun, when a signal reached only some of a machine's ranks (the agent
would count their exit 143 as a failure and start them again), that machine's first rank asks
its agent to stop too; when every rank of the machine got it (the agent itself passes signals on
to all of them, also when it stops them to change the job's size) the agent is left alone.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit.launch.heartbeat import Heartbeat
from gpukit.launch.signals import SECOND_SIGNAL_AFTER_S

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A rank on this machine was asked to stop: the same request, passed on (never a second one).
_PEER_SIGNAL = signal.SIGUSR2

WATCH_S = 0.5  # how often each rank's watcher asks the store whether a rank was signalled
_LEAVE_SECONDS = 10  # at most this long waiting for the other ranks to leave together


def _machine() -> str:
    """Who can signal whom: the same host, boot and process-id namespace (containers on one
    host share its name, not their process ids)."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    return f"{os.uname().nodename}/{boot}/{namespace}"


_MACHINE = _machine()


class Preemption:
    """Catches SIGTERM and SIGINT for a Runtime that has somewhere to save (see the module
    docstring). ``store`` gives the process group's store (called once the group exists);
    ``agent`` is the process id of a torchrun agent to ask to stop when needed, if any;
    ``newest`` gives the step of the newest checkpoint in place and ``writing`` the step of
    one being written in the background, if any (for the message of a stop that could not
    save)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        store: Callable[[], Any],
        heartbeat: Heartbeat | None,
        attempt: int = 0,
        agent: int | None = None,
        newest: Callable[[], int] = lambda: -1,
        writing: Callable[[], int | None] = lambda: None,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._store = store
        self._heartbeat = heartbeat
        self._agent = agent
        self._newest, self._writing = newest, writing
        self._prefix = f"gpukit/preempt/{attempt}/"
        self.requested: str | None = None  # what asked: "SIGTERM received by rank 1"
        self.stop_at: int | None = None
        self._signalled_at: float | None = None  # this process's first signal (monotonic)
        self._posted = False
        self._previous: dict[int, Any] = {}
        self._watcher: threading.Thread | None = None
        self._requested_at = 0.0
        self._closing = False
        # Signal handlers only set attributes and write a byte here: a handler that took a
        # lock (an Event's) could deadlock against itself when a second signal lands inside.
        self._wake_r, self._wake_w = -1, -1
        self._saving = False
        self.installed = False

    def install(self) -> None:
        """Take over SIGTERM and SIGINT (only from the main thread, where Python runs signal
        handlers) and start the watcher (the process group exists by now); ``uninstall``
        puts the previous handlers back."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._previous[_PEER_SIGNAL] = signal.signal(_PEER_SIGNAL, self._on_peer)
        self.installed = True
        store = self._store() if self.world_size > 1 else None
        self._watcher = threading.Thread(
            target=self._watch, args=(store,), name="gpukit-preemption", daemon=True
        )
        self._watcher.start()
        # Before the interpreter tears the process group down, so that no store call of the
        # watcher's is under way then (torch aborts the process if one is).
        atexit.register(self._stop_watching)

    def uninstall(self) -> None:
        """Give the handlers back and stop the watcher (before the process group goes)."""
        self._stop_watching()
        atexit.unregister(self._stop_watching)
        if not self.installed:
            return
        for sig, handler in self._previous.items():
            if sig == _PEER_SIGNAL and handler in (signal.SIG_DFL, None):
                # A rank still running may pass a request on before it learns this one left:
                # SIGUSR2's default would end this process.
                handler = signal.SIG_IGN
            signal.signal(sig, handler)
        self._previous.clear()
        self.installed = False
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _stop_watching(self) -> None:
        self._closing = True
        self._wake()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * WATCH_S + 5)
        self._watcher = None

    def _wake(self) -> None:
        """Cut the watcher's nap short (safe in a signal handler: one write, no lock)."""
        with contextlib.suppress(OSError):  # full (it will wake anyway), or closed
            os.write(self._wake_w, b"!")

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._signalled_at is None:
            self._signalled_at = now
            by = f" by rank {self.rank}" if self.world_size > 1 else ""
            self._request(f"{signal.Signals(signum).name} received{by}")
            self._wake()  # the watcher tells the other ranks now
        elif signum == signal.SIGINT and now - self._signalled_at >= SECOND_SIGNAL_AFTER_S:
            os._exit(128 + signum)  # the user's second Ctrl-C: no more waiting

    def _on_peer(self, signum: int, frame: Any) -> None:
        """Another rank on this machine was signalled: the watcher reads its request now."""
        self._wake()

    def _request(self, what: str) -> None:
        """Attributes only: called from a signal handler and from the watcher."""
        if self.requested is None:
            self.requested = what
            self._requested_at = time.monotonic()
            if self._heartbeat is not None:
                # Written with the next beat, by the main thread alone (one writer per record).
                self._heartbeat.stop_requested = True

    def _give_up(self, grace: float) -> None:
        """No step end came to save at within the grace period: end the process now, saying
        so (a scheduler's SIGKILL would end it without a word)."""
        newest = self._newest()
        saved = f"the newest checkpoint is step {newest}" if newest >= 0 else "no checkpoint"
        writing = self._writing()
        if writing is not None:  # the exit cuts its write short
            saved += f"; the one of step {writing}, still being written, is lost"
        if self.rank == 0:  # every rank gives up alike: said once
            print(
                f"gpukit: {self.requested} {grace:.0f} s ago, and no step ended since to save "
                f"at (GPUKIT_STOP_GRACE): exiting without a save ({saved})",
                file=sys.stderr,
                flush=True,
            )
        os._exit(143)

    def saving(self) -> None:
        """The stop's save begins: the grace period's deadline no longer applies."""
        self._saving = True

    def should_stop(self, step: int) -> bool:
        """At the end of optimizer step ``step``: whether to save and stop now. One flag read
        per step until a request arrives; then a store lookup per step until the ranks
        agree."""
        if self.requested is None:
            return False
        if self.world_size == 1:
            return True
        if self.stop_at is None:
            self._agree(step)
        return self.stop_at is not None and step >= self.stop_at

    def _watch(self, store: Any) -> None:
        """Beside the steps: post where this process runs; post this rank's request in the
        store and pass it on at once to the ranks on this machine, or find another rank's
        request there; and end the process when a request found no step end to save at within
        the grace period (unless gpukit's launcher keeps that deadline)."""
        grace = None if _env.job_dir() is not None else _env.stop_grace()
        told = store is None  # nothing to tell in a world of one
        with contextlib.suppress(Exception):  # the store is gone (the run is ending)
            if store is not None:
                store.set(f"{self._prefix}pid/{self.rank}", f"{_MACHINE} {os.getpid()}")
            while not self._closing:
                if not told and self._signalled_at is not None:
                    # The job's first request stays the one named: a rank the launcher passed
                    # the stop on to (a SIGTERM of its own) says what started it, not its relay.
                    # Answered once the store holds it: then pass it on.
                    key = f"{self._prefix}request"
                    first = store.compare_set(key, "", str(self.requested)).decode()
                    self.requested = first or self.requested
                    self._pass_on(store)
                    told = True
                elif not told and store.check([f"{self._prefix}request"]):
                    self._request(store.get(f"{self._prefix}request").decode())
                    told = True
                nap = WATCH_S if not told else None
                if grace is not None and self.requested is not None and not self._saving:
                    left = self._requested_at + grace - time.monotonic()
                    if left <= 0:
                        self._give_up(grace)
                    nap = left if nap is None else min(nap, left)
                ready, _, _ = select.select([self._wake_r], [], [], nap)
                if ready:
                    os.read(self._wake_r, 512)

    def _peers(self, store: Any) -> dict[int, int]:
        """Rank to process id of the other ranks on this machine that are still running."""
        found = {}
        for rank in range(self.world_size):
            key = f"{self._prefix}pid/{rank}"
            if rank == self.rank or not store.check([key]):
                continue
            machine, pid = store.get(key).decode().rsplit(" ", 1)
            if machine == _MACHINE:
                found[rank] = int(pid)
        return found

    def _pass_on(self, store: Any) -> None:
        """SIGUSR2 to the other ranks on this machine: they learn now, not at their next look
        in the store (ranks elsewhere find the request there)."""
        for pid in self._peers(store).values():
            with contextlib.suppress(OSError):  # gone already: it stops anyway
                os.kill(pid, _PEER_SIGNAL)

    def _agree(self, step: int) -> None:
        store = self._store()
        if not self._posted:
            # add, not set: it returns once the store holds the value, so a rank that sees
            # every post cannot miss this one because it is still on its way.
            store.add(f"{self._prefix}step/{self.rank}", step + 1)
            self._posted = True
        keys = [f"{self._prefix}step/{r}" for r in range(self.world_size)]
        if store.check(keys):
            self.stop_at = max(int(store.get(k)) - 1 for k in keys) + 1

    def leave_together(self) -> None:
        """After the stop's save, before the ranks exit: rank 0 says it has left every
        collective, the others answer and only then exit, and rank 0 exits once all have
        answered. A rank that left the save's last collective and exited at once could reset
        its sockets while a slower peer still read its last message there, turning a clean
        stop into a "connection reset" on that peer. Bounded: a rank that is gone by then
        only shortens the wait. Then a torchrun agent is asked to stop, when needed."""
        self._stop_watching()  # nothing else uses the store from here on
        if self.world_size > 1:
            with contextlib.suppress(Exception):  # the stop goes on whatever the store says
                store = self._store()
                if self._signalled_at is not None:
                    store.set(f"{self._prefix}signalled/{self.rank}", "1")
                store.set(f"{self._prefix}ready/{self.rank}", "1")
            self._leave_together()
        if self._agent is not None and not self._every_local_rank_signalled():
            with contextlib.suppress(OSError):  # gone already: nothing to restart us
                os.kill(self._agent, signal.SIGTERM)

    def _every_local_rank_signalled(self) -> bool:
        """Whether every rank on this machine got the signal itself (then the agent did too,
        or sent it: it needs no word from us)."""
        if self.world_size == 1:
            return self._signalled_at is not None
        with contextlib.suppress(Exception):
            store = self._store()
            local = [self.rank, *self._peers(store)]
            previous = store.timeout
            store.set_timeout(datetime.timedelta(seconds=_LEAVE_SECONDS))
            try:
                store.wait([f"{self._prefix}ready/{r}" for r in local])
            finally:
                store.set_timeout(previous)
            return bool(store.check([f"{self._prefix}signalled/{r}" for r in local]))
        return False

    def _leave_together(self) -> None:
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
