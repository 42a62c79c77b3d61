"""How the launcher and the ranks read the user's stop signals.

Both the supervisor and each rank's preemption handler tell a user's second Ctrl-C from copies
of the first (a terminal sends SIGINT to the whole process group), so they share one threshold;
the launcher's own handlers are :class:`Signals`.

>>> SECOND_SIGNAL_AFTER_S > 0
True
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any

SECOND_SIGNAL_AFTER_S = 2.0  # a SIGINT this long after the first is the user's second Ctrl-C


class Signals:
    """SIGTERM and SIGINT to the launcher, noted and posted to the attempt's queue; installed
    only from the main thread (Python allows no other), restored by ``restore``.

    Copies of the first request do not count twice (a scheduler signals the launcher and its
    ranks alike, a terminal's Ctrl-C reaches every process of its group): only a SIGINT that
    comes ``SECOND_SIGNAL_AFTER_S`` or more after the first is the user's second Ctrl-C, which
    stops the ranks at once (``forced``)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.forced = False
        self.events: queue.SimpleQueue[int] | None = None
        self._first: float | None = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.received.append(signum)
        elif signum == signal.SIGINT and now - self._first >= SECOND_SIGNAL_AFTER_S:
            self.forced = True
        else:
            return  # a copy of the first request
        if self.events is not None:
            self.events.put(-signum)  # SimpleQueue.put is safe in a signal handler

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
