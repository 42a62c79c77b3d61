"""The channel the launchers of one job's nodes talk through during an attempt.

On one machine there is nobody to tell (``LocalPeers``). On several, every node's launcher
reads and writes the key-value store of the attempt's rendezvous (torch's c10d store, under a
prefix of its own per attempt, so nothing of an earlier attempt is ever read back): who failed
first, a hang seen, a stop requested, each node's view of its ranks (``StorePeers``).

Values are small JSON objects; reads never block (the watch loop polls them with the
heartbeats), except ``gather``, which waits a bounded time for every node's answer.

>>> peers = LocalPeers()
>>> peers.claim("hang"), peers.claim("hang")
(True, False)
>>> peers.post("hang/0", {"rank": 3}); peers.read("hang/0")
{'rank': 3}
>>> peers.gather("hang", timeout=0.1)
{0: {'rank': 3}}
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Protocol

POLL_S = 0.05  # between two reads while gathering


class Peers(Protocol):
    """This node's place in the attempt, and the other nodes' launchers."""

    node: int  # this node's rank in the attempt (0..nnodes-1)
    nnodes: int

    def post(self, key: str, value: dict[str, Any]) -> None:
        """Make ``value`` visible to every node under ``key`` (replacing what was there)."""

    def read(self, key: str) -> dict[str, Any] | None:
        """What was posted under ``key``, None if nothing yet; never blocks."""

    def claim(self, key: str) -> bool:
        """True for exactly one caller across all nodes: the first to claim ``key``."""

    def gather(self, key: str, timeout: float) -> dict[int, dict[str, Any]]:
        """Every node's ``{key}/{node}`` post, waiting up to ``timeout`` seconds for the missing
        ones; a node that posted nothing in time is left out."""


class LocalPeers:
    """One machine: the whole job is here."""

    def __init__(self) -> None:
        self.node = 0
        self.nnodes = 1
        self._values: dict[str, dict[str, Any]] = {}
        self._claimed: set[str] = set()

    def post(self, key: str, value: dict[str, Any]) -> None:
        self._values[key] = value

    def read(self, key: str) -> dict[str, Any] | None:
        return self._values.get(key)

    def claim(self, key: str) -> bool:
        first = key not in self._claimed
        self._claimed.add(key)
        return first

    def gather(self, key: str, timeout: float) -> dict[int, dict[str, Any]]:
        value = self._values.get(f"{key}/0")
        return {} if value is None else {0: value}


class StorePeers:
    """Several machines: the attempt's rendezvous store (a ``torch.distributed.Store``, already
    prefixed for this attempt), shared by every node's launcher."""

    def __init__(self, store: Any, node: int, nnodes: int) -> None:
        self.node = node
        self.nnodes = nnodes
        self._store = store
        self._prefix = "gpukit/"

    def post(self, key: str, value: dict[str, Any]) -> None:
        name = self._prefix + key
        self._store.set(name, json.dumps(value))
        # A TCPStore client sends SET without waiting for an answer, so another node's read
        # could still miss it. The server answers one connection's requests in order: once
        # this CHECK is answered, the SET before it is in the store for every reader.
        self._store.check([name])

    def read(self, key: str) -> dict[str, Any] | None:
        name = self._prefix + key
        if not self._store.check([name]):
            return None
        found: dict[str, Any] = json.loads(self._store.get(name))
        return found

    def claim(self, key: str) -> bool:
        return int(self._store.add(self._prefix + "claim/" + key, 1)) == 1

    def gather(self, key: str, timeout: float) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while True:
            for node in range(self.nnodes):
                if node not in found:
                    value = self.read(f"{key}/{node}")
                    if value is not None:
                        found[node] = value
            if len(found) == self.nnodes or time.monotonic() >= deadline:
                return found
            time.sleep(POLL_S)


def tcp_peers(host: str, port: int, node: int, nnodes: int) -> StorePeers:
    """Peers over a fresh TCPStore at ``host:port`` that node 0 hosts (tests, examples)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, port, nnodes, node == 0, timedelta(seconds=30), wait_for_workers=False)
    return StorePeers(store, node, nnodes)
