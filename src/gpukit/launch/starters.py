"""How a job's ranks start, behind one interface: the supervisor asks its ``RankStarter`` for
each rank's process and never asks which kind it holds.

Two kinds start ranks: a command (a script or a module, through the runner, or ``rt.launch``'s
call file for a function a fresh interpreter imports by reference), each rank a fresh process
(``CommandStarter``, by ``workers.start_worker``); and a Python function this process defined
where no fresh interpreter could find it, each rank a fork of this process
(``gpukit.launch.functions.ForkStarter``).

>>> import queue, sys
>>> events = queue.SimpleQueue()
>>> starter = CommandStarter([sys.executable, "-c", "pass"])
>>> w = starter.start(0, {}, events)
>>> events.get(timeout=30), w.returncode, starter.is_interactive_compatible
(0, 0, False)
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from collections.abc import Mapping

from gpukit.launch.workers import Worker, start_worker


class RankStarter(ABC):
    """One way to start a job's ranks, each a process that ends on its own or by a signal."""

    @abstractmethod
    def start(self, rank: int, env: Mapping[str, str], events: queue.SimpleQueue[int]) -> Worker:
        """Start rank ``rank`` with exactly ``env``; ``events`` receives ``rank`` the moment it
        ends. Called from the thread that runs the whole job (see ``workers``)."""

    @property
    @abstractmethod
    def is_interactive_compatible(self) -> bool:
        """Whether it can run what an interactive session defined (a notebook, ``python -c``,
        a lambda): only a fork of this process holds that."""


class CommandStarter(RankStarter):
    """Each rank runs ``command`` as a fresh process."""

    def __init__(self, command: list[str]) -> None:
        self.command = list(command)

    def start(self, rank: int, env: Mapping[str, str], events: queue.SimpleQueue[int]) -> Worker:
        return start_worker(rank, self.command, env, events)

    @property
    def is_interactive_compatible(self) -> bool:
        return False
