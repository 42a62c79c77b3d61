"""Restarts in seconds: a job that may restart keeps a warm-start server of its own.

A restarted attempt started cold pays what the first one paid: every rank a fresh interpreter
importing torch (seconds of CPU each). When a job may restart (``max_restarts > 0``) and the
user gave no server (``GPUKIT_WARM_START``), the launcher starts one (``gpukit.launch.warm``)
as the job starts, in the background, and forks every restarted attempt's ranks from it.

- Attempt 0 starts cold, at once, as before: the server is spawned beside it and imports torch
  while the ranks do, so a server that is slow or fails to start never holds the job back (on
  a machine with fewer cores than ranks + 1 it takes CPU from them meanwhile). By the first
  failure it is ready, or the restart waits the rest of its start-up, less than a cold start.
- The server lives as long as the launcher: spawned from the job's thread it dies with it
  (``PR_SET_PDEATHSIG``, a SIGKILL of the launcher included), its forked ranks die with it,
  and the launcher kills it when the job ends. Its socket is in the job's folder (in a
  temporary folder when that path is too long for a Unix socket). On several nodes each
  node's launcher keeps its own.
- The server is started with the job's environment (the launcher's, with the job's own
  variables on top, less ``OMP_NUM_THREADS``, which each rank applies itself): what Python
  and torch read at start (``PYTHONHASHSEED``, ``PYTHONPATH``, ``TORCH_*``, ``MKL_*``...) is
  what a cold rank reads. What even that cannot give a fork is listed in ``UNHONOURED``
  (variables that make Python report or hook its own start-up, which the server's start-up
  would answer instead of the rank's): with one of them set, restarts start cold, and the
  launcher says so once.
- Anything else that keeps the server from serving (it died, did not start, the command is not
  gpukit's runner) makes the restarts start cold, said once; it never fails the job.
- ``GPUKIT_WARM_RESTART=0`` turns it off (every attempt cold, as before).

>>> unhonoured({"PYTHONPROFILEIMPORTTIME": "1", "PATH": "/bin"})
['PYTHONPROFILEIMPORTTIME']
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from gpukit import _env
from gpukit.errors import LaunchError
from gpukit.launch import warm_client
from gpukit.launch.starters import CommandStarter, RankStarter
from gpukit.launch.workers import Worker, start_worker

# Variables by which Python reports on, or hooks, its own start-up: a forked rank would get
# the server's start-up (its import times, its traced allocations, its startup file) instead.
UNHONOURED = (
    "PYTHONPROFILEIMPORTTIME",
    "PYTHONTRACEMALLOC",
    "PYTHONMALLOCSTATS",
    "PYTHONINSPECT",
    "PYTHONVERBOSE",
    "PYTHONDUMPREFS",
)
SOCKET_NAME = "warm.sock"
# sun_path holds 108 bytes on Linux (104 on macOS), the final NUL included.
_MAX_SOCKET_PATH = 100
# How long a restart waits for a server still importing (it started with the job, so this is
# only reached when something is badly wrong, such as a machine swapping).
READY_TIMEOUT_S = 300.0


def unhonoured(env: Mapping[str, str]) -> list[str]:
    """The variables set in ``env`` that a forked rank could not honour."""
    return [name for name in UNHONOURED if env.get(name)]


class WarmRestarts(RankStarter):
    """Starts attempt 0's ranks cold and every restarted attempt's from the job's own warm
    server; use :meth:`for_job`, which decides whether the job gets one."""

    def __init__(self, command: list[str], env: Mapping[str, str], folder: Path) -> None:
        self.command = list(command)
        self.cold = CommandStarter(command)
        self.note: str | None = None  # why restarts start cold, said once by the launcher
        self._told = False
        self._short_dir: str | None = None
        self.path = folder / SOCKET_NAME
        if len(os.fsencode(self.path)) > _MAX_SOCKET_PATH:
            self._short_dir = tempfile.mkdtemp(prefix="gpukit-warm-")
            self.path = Path(self._short_dir) / SOCKET_NAME
        self._ready = False
        self.server: subprocess.Popen[bytes] | None = None
        try:
            # Spawned from this thread, the job's: it dies with it (PR_SET_PDEATHSIG).
            self.server = warm_client.spawn_server(self.path, env=server_env(env))
        except OSError as err:  # no process to spare: the job runs all the same, cold
            self._give_up(f"the job's warm-start server did not start ({err})")

    @classmethod
    def for_job(
        cls, command: list[str], env: Mapping[str, str], folder: Path, max_restarts: int
    ) -> tuple[RankStarter, str | None]:
        """The starter for ``command``'s ranks, and why restarts will start cold (None when
        they will not, or when no one need be told: a job that never restarts, a server the
        user gave, the opt-out)."""
        wanted = _env.warm_restart()  # read first: a wrong value is refused whatever the job
        if max_restarts == 0 or _env.warm_start() is not None or not wanted:
            return CommandStarter(command), None
        if warm_client.runner_args(command) is None:
            return CommandStarter(command), None  # the server runs gpukit's runner only
        names = unhonoured(env)
        if names:
            why = (
                f"{', '.join(names)} set: a rank forked from a warm interpreter would not "
                "honour it, so restarts start every rank as a fresh interpreter"
            )
            return CommandStarter(command), why
        return cls(command, env, folder), None

    def start(self, rank: int, env: Mapping[str, str], events: queue.SimpleQueue[int]) -> Worker:
        if env.get("GPUKIT_ATTEMPT", "0") == "0" or self.server is None:
            return self.cold.start(rank, env, events)
        path = self._wait()
        if path is not None:
            try:
                return start_worker(rank, self.command, env, events, warm=path)
            except LaunchError:  # it died in the meantime: why, it printed on stderr
                self._give_up(f"the job's warm-start server did not start rank {rank}")
        return self.cold.start(rank, env, events)

    def told(self) -> str | None:
        """Why restarts now start cold, the first time it is asked after that became so."""
        if self.note is None or self._told:
            return None
        self._told = True
        return self.note

    def _wait(self) -> str | None:
        """The server's socket once it answers; None (and a note) if it never will."""
        if self.server is None:
            return None
        if not self._ready:
            try:
                warm_client.wait_for_server(self.server, self.path, READY_TIMEOUT_S)
            except LaunchError as err:
                self.server = None  # wait_for_server killed it
                self._give_up(str(err))
                return None
            self._ready = True
        if self.server.poll() is not None:
            self._give_up(f"the warm-start server ended (exit {self.server.returncode})")
            return None
        return str(self.path)

    def _give_up(self, why: str) -> None:
        self.close()
        if self.note is None:
            self.note = f"{why}: restarts start every rank as a fresh interpreter"

    def close(self) -> None:
        """Stop the server (its ranks, if any are left, die with it) and remove its socket."""
        if self.server is not None:
            with contextlib.suppress(ProcessLookupError):
                self.server.kill()
            self.server.wait()
            self.server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._short_dir is not None:
            shutil.rmtree(self._short_dir, ignore_errors=True)
            self._short_dir = None

    @property
    def is_interactive_compatible(self) -> bool:
        return False


def server_env(env: Mapping[str, str]) -> dict[str, str]:
    """The job's environment for its server: what a cold rank's interpreter and torch read at
    start, less what a rank applies itself (``OMP_NUM_THREADS``) or the server must not see
    (a warm-start socket of its own)."""
    dropped = ("OMP_NUM_THREADS", "GPUKIT_WARM_START")
    return {name: value for name, value in env.items() if name not in dropped}
