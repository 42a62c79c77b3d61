"""One attempt of a job: start every rank, watch them, stop them all when one fails or hangs.

The attempt's thread waits on one queue: the waiting threads of the workers post a rank the
moment it ends, the launcher's signal handlers post the signal, and every ~0.15 s it wakes
anyway to read the heartbeats. After the first failure the other ranks get a short grace (they
usually fail on their own, on the broken connection, which dates their failure) and are then
SIGKILLed with their process groups: never SIGTERM, which asks a gpukit rank to save and stop.

SIGTERM or SIGINT to the launcher is forwarded to every rank as SIGTERM (they finish the step,
save and exit 143) and the launcher waits up to ``stop_timeout`` seconds before killing them; the
user's second Ctrl-C kills them at once, copies of the first request count once. A rank whose
heartbeat says it was asked to stop, or that ended by SIGTERM or SIGINT (a scheduler signalled
that one process), has the request relayed to the others, once; the ranks of a gpukit Runtime
also tell each other through their process group's store.

On several nodes the attempt's ranks are this node's share of the job (global ranks
``node * nproc + local rank``), and the watch also hears the other nodes
(``node_messages.NodeLink``): a failure or a stop request on any node stops every node's ranks
alike.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gpukit.launch.attempt_watch import AttemptWatch, Outcome
from gpukit.launch.job_records import JobRecord
from gpukit.launch.node_channel import LocalPeers, Peers
from gpukit.launch.restarts import Progress
from gpukit.launch.signals import Signals
from gpukit.launch.starters import RankStarter
from gpukit.launch.workers import Worker

POLL_S = 0.15  # how often heartbeats are read


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every attempt of a job shares; built by name, since many of its fields are numbers
    that a position would mix up."""

    ranks: RankStarter  # how each rank's process starts: a command, or forks for a function
    nproc: int
    env: dict[str, str]
    folder: Path
    max_restarts: int
    hang_timeout: float | None
    grace: float  # seconds the other ranks get to fail on their own after the first failure
    stop_timeout: float  # seconds ranks get to save and exit after a forwarded SIGTERM
    name: str
    out: TextIO
    startup_timeout: float | None = None  # seconds from a rank's start to its first beat
    on_attempt: Callable[[Attempt, Outcome], None] | None = None  # told how each one ended
    record: JobRecord | None = None  # live.json, events, --out's records (job_records)


@dataclass
class Attempt:
    """Attempt number ``number`` of a job, its ranks on ``port``: this node's ranks of the
    job's, its place in the job and the other nodes given by ``peers``."""

    settings: Settings
    number: int
    port: int
    signals: Signals
    resumes_from: int = 0  # the step of the last checkpoint known (0: none)
    workers: list[Worker] = field(default_factory=list)
    peers: Peers = field(default_factory=LocalPeers)  # the other nodes' launchers
    master_addr: str = "127.0.0.1"
    waiting: Callable[[], int] | None = None  # nodes waiting to join (elastic), asked by node 0

    def run(self) -> Outcome:
        s = self.settings
        events: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.signals.events = events
        progress = Progress(time.time(), s.nproc, self.resumes_from)
        base = self.peers.node * s.nproc  # Worker.rank is the rank in the whole job
        self.workers = [
            s.ranks.start(base + local, self._env(base + local, local), events)
            for local in range(s.nproc)
        ]
        watch = AttemptWatch(self, progress)
        handled = 0  # a signal that came between two attempts stops this one at once
        while any(w.alive for w in self.workers):
            with contextlib.suppress(queue.Empty):
                events.get(timeout=POLL_S)
            news = len(self.signals.received) + self.signals.forced
            if news > handled:
                handled = news
                watch.on_signals()
            watch.check(time.time())
        for worker in self.workers:
            worker.kill()  # what a rank left behind in its group (DataLoader workers)
        outcome = watch.outcome()
        outcome.stopping = watch.stopping
        if s.on_attempt is not None:
            s.on_attempt(self, outcome)
        return outcome

    def _env(self, rank: int, local: int | None = None) -> dict[str, str]:
        s = self.settings
        return {
            **s.env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank if local is None else local),
            "WORLD_SIZE": str(s.nproc * self.peers.nnodes),
            "LOCAL_WORLD_SIZE": str(s.nproc),
            "GROUP_RANK": str(self.peers.node),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(s.nproc * self.peers.nnodes),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.port),
            "TORCHELASTIC_ERROR_FILE": str(self.error_file(rank)),
            "TORCHELASTIC_RESTART_COUNT": str(self.number),
            "TORCHELASTIC_MAX_RESTARTS": str(s.max_restarts),
            "GPUKIT_JOB_DIR": str(s.folder),
            "GPUKIT_ATTEMPT": str(self.number),
        }

    def error_file(self, rank: int) -> Path:
        return self.settings.folder / f"error-{rank}-{self.number}.json"
