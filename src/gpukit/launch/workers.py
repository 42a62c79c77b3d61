"""Starting and stopping the processes of one attempt: one per rank, none outliving the launcher.

Each worker is started in a process group of its own, so stopping a rank (``killpg``) stops the
processes it started too (DataLoader workers, compilers). On Linux each worker also asks the
kernel to SIGKILL it when the launcher dies (``PR_SET_PDEATHSIG``), even by SIGKILL, which no
handler in the launcher could see. The kernel sends that signal when the *thread* that started
the worker ends, so workers are started from the thread that runs the whole job. Elsewhere
(macOS) the launcher kills its workers' groups on its way out (``atexit``, and the handlers of
SIGTERM/SIGINT), which covers everything but a SIGKILL of the launcher.

One thread per worker waits for it and notes the nanosecond it ended: a rank killed by a signal
leaves no error record, and this time is what tells it failed before the peers that lost their
connection to it.

>>> import queue, sys
>>> events = queue.SimpleQueue()
>>> w = start_worker(0, [sys.executable, "-c", "pass"], {}, events)
>>> events.get(timeout=30), w.returncode
(0, 0)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gpukit import _env
from gpukit.launch import warm_client

_PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>


class Process(Protocol):
    """What a worker needs of its process: a ``subprocess.Popen``, or a forked process that
    leads a process group of its own (``gpukit.launch.functions``)."""

    pid: int
    returncode: int | None

    def wait(self) -> int: ...


@dataclass(eq=False)
class Worker:
    """One rank's process; ``ended_ns`` is set (by its waiting thread) the moment it ends."""

    rank: int
    proc: Process
    started: float  # time.time() just before it was started
    ended_ns: int | None = None
    stopped: bool = False  # the launcher killed it (it did not end on its own)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return not self._done.is_set()

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: the signal that ended it), None while it runs."""
        return self.proc.returncode if self._done.is_set() else None

    def send(self, sig: int) -> None:
        """Send ``sig`` to the rank's own process (not its group), while it runs."""
        if self.alive:
            # It may have ended between the check and the signal.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the rank's whole process group (its DataLoader workers too); a rank still
        running then counts as stopped by the launcher rather than failed."""
        if self.alive:
            self.stopped = True
        _kill_group(self.pid)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it ended within ``timeout`` seconds."""
        return self._done.wait(timeout)


# Workers not yet known to be gone, for the exit-time cleanup where PDEATHSIG is missing.
_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def start_worker(
    rank: int,
    command: list[str],
    env: Mapping[str, str],
    events: queue.SimpleQueue[int],
    warm: str | None = None,
) -> Worker:
    """Start ``command`` as rank ``rank`` with exactly ``env``; ``events`` receives ``rank`` the
    moment it ends. Call from a thread that lives as long as the job (see the module doc).
    ``warm``: the socket of the warm-start server to fork it from (default
    ``GPUKIT_WARM_START``'s, if set)."""
    started = time.time()
    server = warm if warm is not None else _env.warm_start()
    args = warm_client.runner_args(command) if server is not None else None
    if server is not None and args is not None:
        # Forked by the warm-start server (``gpukit.launch.warm``), which has imported torch.
        proc: Process = warm_client.start_rank(server, args, env)
    else:
        proc = subprocess.Popen(
            command,
            env=dict(env),
            start_new_session=True,
            preexec_fn=_die_with(os.getpid()) if _PRCTL is not None else None,
        )
    return watch_worker(rank, proc, started, events)


def watch_worker(
    rank: int, proc: Process, started: float, events: queue.SimpleQueue[int]
) -> Worker:
    """The worker of ``proc``, started at ``started``: a thread waits for it and posts ``rank``
    to ``events`` the moment it ends."""
    worker = Worker(rank, proc, started)
    _LIVE.add(worker)
    threading.Thread(
        target=_wait, args=(worker, events), name=f"gpukit-rank-{rank}", daemon=True
    ).start()
    return worker


def _wait(worker: Worker, events: queue.SimpleQueue[int]) -> None:
    worker.proc.wait()
    worker.ended_ns = time.time_ns()
    worker._done.set()
    _LIVE.discard(worker)
    events.put(worker.rank)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
        os.killpg(pgid, signal.SIGKILL)


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    # The C library this process already has loaded (None: its own symbols): finding it by
    # name would run `ldconfig` in a subprocess at import.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl_found: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return prctl_found


# Looked up once, here: the child between fork and exec must not load libraries.
_PRCTL = _load_prctl()


def _die_with(parent: int) -> Callable[[], None]:
    """What the child runs between fork and exec: die with ``parent``."""

    def child() -> None:
        die_with(parent)

    return child


def die_with(parent: int) -> None:
    """In a child of ``parent``: ask the kernel to SIGKILL this process when ``parent`` (the
    thread that started it) dies (Linux; nothing elsewhere)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before the call above: then no signal would ever come.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_leftovers() -> None:
    """SIGKILL the groups of every worker still running: the launcher is on its way out."""
    for worker in list(_LIVE):
        worker.kill()


# Where PDEATHSIG exists it covers this too, and a SIGKILL of the launcher besides.
atexit.register(kill_leftovers)
