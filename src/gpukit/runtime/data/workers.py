"""What a DataLoader's worker processes do besides loading: leave SIGTERM and SIGINT to the
main process, so that a preemption or a Ctrl-C lets the main process finish its step and save.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any


class MainStops:
    """A DataLoader worker's ``worker_init_fn`` that first leaves SIGTERM and SIGINT to the
    main process, then calls the program's own (if any). A scheduler signals every process of
    the job (Slurm's ``scancel``), a terminal's Ctrl-C its whole process group: workers that
    died of it would fail the main process's next batch ("DataLoader worker exited
    unexpectedly") before it could finish the step and save. The main process stops its
    workers itself, and they stop when it dies.

    >>> MainStops(None)(0)
    """

    def __init__(self, user: Callable[[int], Any] | None) -> None:
        self.user = user

    def __call__(self, worker_id: int) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            # A handler that does nothing, not SIG_IGN: a program the worker starts (a
            # decoder) gets the default back, as a handler is not inherited across exec.
            signal.signal(sig, _left_to_main)
        if self.user is not None:
            self.user(worker_id)


def _left_to_main(signum: int, frame: Any) -> None:
    """A loader worker's SIGTERM or SIGINT: the main process decides (see ``MainStops``)."""
