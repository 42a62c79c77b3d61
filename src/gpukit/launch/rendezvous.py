"""Where the launchers of a job's nodes meet, once per attempt.

One node meets nobody (``LocalMeeting``): its ranks use 127.0.0.1 and a free port. Several
nodes meet through torch's c10d rendezvous (``StoreMeeting``): node 0's launcher (``--node-rank
0``) hosts its store at ``--master-addr:--master-port``, the others connect, and every attempt
is a new round of it, whose store is prefixed per round (nothing of an earlier attempt is read
back). Each round, the launchers post under ``gpukit/``:

- ``node/{r}`` (each, ``r`` its place in the round): its ``--node-rank``, ``--nproc`` and host.
  Every node must run the same number of ranks; nodes are numbered by their ``--node-rank``
  when those are 0..N-1 (a fixed ``--nnodes``), else in the rendezvous' order;
- ``master`` (node 0): the address and free port of the ranks' own rendezvous
  (``MASTER_ADDR``/``MASTER_PORT``), and the job's state: its attempt number, restarts used,
  newest checkpoint and the faults so far, which every node adopts, so that every node decides
  the same about the next restart, a node that joined late too.

Built on torch's rendezvous handler and its store, rather than on a subclass of torch's
``LocalElasticAgent``: see docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import math
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from gpukit import _env
from gpukit.errors import LaunchError
from gpukit.launch.failures import Fault, first_line
from gpukit.launch.node_channel import LocalPeers, Peers, StorePeers
from gpukit.launch.ports import free_port

LOCAL = "127.0.0.1"
ANSWER_S = 60.0  # the most a node waits for the others' posts of a round it has joined
CLOSE_WAIT_S = 15.0  # the most node 0 keeps its store up for the others at the job's end


@dataclass(frozen=True)
class Nodes:
    """A job over several machines, as ``gpukit launch --nnodes MIN[:MAX]`` gives it."""

    min_nodes: int
    max_nodes: int
    node_rank: int  # --node-rank: 0 hosts the rendezvous
    master_addr: str
    master_port: int

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.max_nodes


@dataclass
class JobState:
    """What every node must agree on to decide alike: node 0's copy is the job's."""

    attempt: int = 0  # the job's attempt number (GPUKIT_ATTEMPT)
    used: int = 0  # restarts after failures so far
    checkpoint: int = -1  # the newest checkpoint every rank took part in (-1: none)
    furthest: int = -1  # the furthest step an attempt advanced to (-1: none did)
    faults: list[Fault] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        faults = [vars(f) for f in self.faults]
        return {
            "attempt": self.attempt,
            "used": self.used,
            "checkpoint": self.checkpoint,
            "furthest": self.furthest,
            "faults": faults,
        }

    def adopt(self, data: dict[str, Any]) -> None:
        self.attempt, self.used = int(data["attempt"]), int(data["used"])
        self.checkpoint = int(data["checkpoint"])
        self.furthest = int(data.get("furthest", -1))
        self.faults = [Fault(**f) for f in data["faults"]]


@dataclass
class Place:
    """This node's part in one attempt."""

    peers: Peers
    master_addr: str
    port: int
    nnodes: int = 1


class LocalMeeting:
    """One machine: nobody to meet."""

    def __init__(self, master_port: int | None) -> None:
        self.first_port = master_port

    def next(self, state: JobState) -> Place:
        port, self.first_port = self.first_port or free_port(), None
        return Place(LocalPeers(), LOCAL, port)

    def waiting(self) -> int:
        return 0

    def close(self) -> None:
        """One machine hosts no meeting point: nothing to close."""


class StoreMeeting:
    """Several machines: a round of torch's c10d rendezvous per attempt."""

    def __init__(self, nodes: Nodes, nproc: int) -> None:
        self.nodes, self.nproc = nodes, nproc
        self.handler: Any = None
        self.peers: StorePeers | None = None

    def _handler(self) -> Any:
        if self.handler is None:
            from torch.distributed.elastic.rendezvous import RendezvousParameters
            from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

            n = self.nodes
            # Each round's ranks get their MASTER_PORT from node 0 (below), not a store that
            # torch would otherwise start on rank 0 for them and keep across rounds.
            _env.share_rendezvous_store(False)
            params = RendezvousParameters(
                backend="c10d",
                endpoint=f"{n.master_addr}:{n.master_port}",
                run_id=f"gpukit-{n.master_port}",
                min_nodes=n.min_nodes,
                max_nodes=n.max_nodes,
                join_timeout=_env.rendezvous_timeout(),
                # Whole seconds: torch reads it as an integer.
                last_call_timeout=max(math.ceil(_env.rendezvous_last_call()), 1),
                # Also how long a node waits to reach node 0's store at all.
                read_timeout=max(math.ceil(_env.rendezvous_timeout()), 1),
                is_host=n.node_rank == 0,
            )
            try:
                self.handler = get_rendezvous_handler(params)
            except Exception as err:  # the store could not be reached or hosted
                raise LaunchError(self._meeting(err)) from None
        return self.handler

    def next(self, state: JobState) -> Place:
        n = self.nodes
        handler = self._handler()
        try:
            info = handler.next_rendezvous()
        except Exception as err:
            raise LaunchError(self._meeting(err)) from None
        # torch < 2.5 gives (store, rank, world_size), later a RendezvousInfo.
        if isinstance(info, tuple):
            store, rank, world = info[0], int(info[1]), int(info[2])
        else:
            store, rank, world = info.store, int(info.rank), int(info.world_size)
        self.peers = StorePeers(store, rank, world)  # until every node is known
        try:
            return self._meet(state, store, rank, world)
        except LaunchError:
            raise
        except Exception as err:  # node 0's launcher, which hosts the store, went away
            said = first_line(str(err)) or type(err).__name__
            raise LaunchError(
                f"node {n.node_rank} lost node 0's meeting point at {n.master_addr}:"
                f"{n.master_port} while the nodes met ({said}): node 0's `gpukit launch` ended "
                "(see its output)"
            ) from None

    def _meet(self, state: JobState, store: Any, rank: int, world: int) -> Place:
        n = self.nodes
        assert self.peers is not None
        meeting = self.peers
        meeting.post(
            f"node/{rank}",
            {"node_rank": n.node_rank, "nproc": self.nproc, "host": socket.getfqdn()},
        )
        seen = meeting.gather("node", ANSWER_S)
        if len(seen) < world:
            raise LaunchError(f"only {len(seen)} of the {world} nodes that met said who they are")
        counts = {int(v["nproc"]) for v in seen.values()}
        if len(counts) > 1:
            each = ", ".join(
                f"{v['host']} (--node-rank {v['node_rank']}) runs {v['nproc']}"
                for v in seen.values()
            )
            raise LaunchError(
                f"the nodes run different numbers of processes ({each}): give every node the "
                "same --nproc"
            )
        asked = sorted(int(v["node_rank"]) for v in seen.values())
        node = n.node_rank if asked == list(range(world)) else rank
        peers = StorePeers(store, node, world)
        self.peers = peers
        if node == 0:
            # Node 0's ranks host the ranks' rendezvous: at the address the others reach it by.
            addr = n.master_addr if n.node_rank == 0 else socket.getfqdn()
            peers.post("master", {"addr": addr, "port": free_port(""), "job": state.to_json()})
        master = _wait_for(peers, "master", ANSWER_S)
        if master is None:
            raise LaunchError(f"node 0 did not post its address within {ANSWER_S:g} s")
        state.adopt(master["job"])
        return Place(peers, str(master["addr"]), int(master["port"]), world)

    def waiting(self) -> int:
        """Nodes waiting to join: the running attempt makes room for them (elastic)."""
        try:
            return int(self._handler().num_nodes_waiting())
        except Exception:
            return 0

    def close(self) -> None:
        """The job is over: a node still waiting for a round is told at once; node 0, which
        hosts the store, waits a little for the others to have read what they need."""
        if self.handler is None:
            return
        with contextlib.suppress(Exception):
            self.handler.set_closed()
        if self.peers is not None:
            with contextlib.suppress(Exception):
                self.peers.post(f"closed/{self.peers.node}", {})
                if self.nodes.node_rank == 0:
                    self.peers.gather("closed", CLOSE_WAIT_S)

    def _meeting(self, err: BaseException) -> str:
        n = self.nodes
        if type(err).__name__ == "RendezvousClosedError":
            return (
                f"node {n.node_rank}: the job was ended by another node (it stopped, failed or "
                "was asked to stop) while this one waited to start the next attempt"
            )
        said = first_line(str(err)) or type(err).__name__
        count = str(n.min_nodes) if not n.elastic else f"at least {n.min_nodes}"
        return (
            f"node {n.node_rank} waited {_env.rendezvous_timeout():g} s at "
            f"{n.master_addr}:{n.master_port} for {count} nodes to join, in vain ({said}): "
            "every node must start `gpukit launch` with the same --nnodes, --master-addr and "
            "--master-port, and reach node 0 there (a firewall?); "
            "GPUKIT_RENDEZVOUS_TIMEOUT=SECONDS waits longer"
        )


def _wait_for(peers: Peers, key: str, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while (found := peers.read(key)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return found
