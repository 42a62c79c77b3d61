"""The launcher's watch for ranks stuck in start-up or hung, over every node of a job.

Two bounds, each on a clock of its own:

- **start-up**: from a rank's start to its first heartbeat (importing torch, joining the
  process group, loading data) a rank has ``startup_timeout`` seconds. Only a job that beats is
  watched (some rank, on any node, has beaten: it runs a gpukit Runtime); a rank that has not
  beaten by then is stuck in start-up.
- **hang**: a rank's hang clock starts at its first beat, and only once every rank of the job
  has beaten: a rank that beat and then waits in the rendezvous or a collective for a peer still
  importing is waiting, not hung. From then on, a rank without a beat for ``hang_timeout``
  seconds is hung, and the rank furthest behind is blamed (``hang_reports.blame``).

Across nodes (``node_channel``): the node that sees a local rank over a bound claims ``hang`` (the
first claim leads) and posts what it saw; every node reads ``hang`` at each wake-up. On seeing
it, each node asks its ranks for their stacks (SIGUSR1), posts ``hang/<node>`` with each rank's
age since its last beat (ages, not times: clocks differ between machines), step, phase and
stack, and gathers every node's post; then every node computes the same report from the same
posts (``judge``) and stops its ranks. On one machine (``LocalPeers``) the same steps run
without anybody to tell.

Reads of the store: ``hang`` once per wake-up; during start-up, at most a few keys per second
(``began``, then each node's ``started/<node>`` in turn), none once every rank has beaten.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpukit.launch.hang_reports import (
    Frame,
    Watch,
    furthest_behind,
    hang_report,
    startup_report,
    user_frame,
)
from gpukit.launch.heartbeat import Beat
from gpukit.launch.node_channel import Peers

GATHER_S = 20.0  # how long a node waits for every node's stacks (each takes up to ~2.5 s)
START_POLL_S = 1.0  # between two reads of the other nodes' start-up, on several nodes
MAX_FRAMES = 100  # innermost frames of a rank's stack sent to the other nodes


@dataclass(frozen=True)
class Local:
    """One of this node's ranks as the watch sees it: when its process started and its last
    beat (this machine's ``time.time()``), and whether it still runs."""

    rank: int
    started: float
    beat: Beat | None
    alive: bool = True


@dataclass(frozen=True)
class Found:
    """A rank stuck in start-up or hung, as every node reports it."""

    kind: str  # "start" or "hang"
    rank: int
    node: int
    step: int | None  # None: it never beat
    where: str  # its line, "no stack" when it wrote none
    text: str  # "rank 1 hung at step 3 (phase loop)": the fault's words
    report: str  # the lines to print (the same on every node)


class HangWatch:
    """This node's side of the watch; ``check`` at every wake-up of the attempt."""

    def __init__(
        self,
        peers: Peers,
        hang_timeout: float | None,
        startup_timeout: float | None,
        name: str,
        gather_s: float = GATHER_S,
    ) -> None:
        self.peers = peers
        self.hang_timeout = hang_timeout or None
        self.startup_timeout = startup_timeout or None
        self.name = name
        self.gather_s = gather_s
        self.began = False  # some rank of the job has beaten
        self.all_began_at: float | None = None  # when this node knew every rank had beaten
        self._said_began = False
        self._said_started = False
        self._next_node = 0  # the first node not yet known to have every rank beaten
        self._polled = -math.inf

    @property
    def active(self) -> bool:
        return self.hang_timeout is not None or self.startup_timeout is not None

    def check(
        self, now: float, ranks: list[Local], dump: Callable[[], dict[int, list[Frame]]]
    ) -> Found | None:
        """None while nothing is stuck; else, after every node has answered (or the gather
        timed out), what was found. ``dump`` has this node's live ranks write their stacks and
        returns them."""
        if not self.active:
            return None
        self._starting(now, ranks)
        seen = self.peers.read("hang")
        if seen is None:
            suspect = self.suspect(now, ranks)
            if suspect is None:
                return None
            if self.peers.claim("hang"):
                self.peers.post("hang", suspect)
        stacks = dump()
        self.peers.post(f"hang/{self.peers.node}", answer(now, ranks, stacks))
        posts = self.peers.gather("hang", self.gather_s)
        return judge(posts, self.peers.nnodes, self.name, self.startup_timeout, self.gather_s)

    def suspect(self, now: float, ranks: list[Local]) -> dict[str, Any] | None:
        """What this node sees over a bound (a rank that did not start, or one that stopped
        beating once all had begun), or None."""
        if not self.began:
            return None  # no rank beats: not a gpukit Runtime, or none has started yet
        node = self.peers.node
        if self.startup_timeout is not None:
            late = [
                r.rank
                for r in ranks
                if r.alive and r.beat is None and now - r.started > self.startup_timeout
            ]
            if late:
                return {"kind": "start", "node": node, "ranks": late}
        if self.hang_timeout is not None and self.all_began_at is not None:
            since = self.all_began_at
            stale = [
                r.rank
                for r in ranks
                if r.alive
                and r.beat is not None
                and now - max(r.beat.time, since) > self.hang_timeout
            ]
            if stale:
                return {"kind": "hang", "node": node, "ranks": stale}
        return None

    def _starting(self, now: float, ranks: list[Local]) -> None:
        """Follow the job's start-up: some rank beat (``began``), every rank did
        (``all_began_at``), here and on the other nodes."""
        if self.all_began_at is not None:
            return
        peers, node = self.peers, self.peers.node
        if not self._said_began and any(r.beat is not None for r in ranks):
            self.began = self._said_began = True
            if peers.nnodes > 1:
                peers.post("began", {"node": node})
        if not self._said_started and all(r.beat is not None or not r.alive for r in ranks):
            self._said_started = True
            if peers.nnodes > 1:
                peers.post(f"started/{node}", {})
        if peers.nnodes > 1 and now - self._polled < START_POLL_S:
            return
        self._polled = now
        if not self.began and peers.read("began") is not None:
            self.began = True
        while self._next_node < peers.nnodes:
            other = self._next_node
            if other == node:
                if not self._said_started:
                    return
            elif peers.read(f"started/{other}") is None:
                return
            self._next_node += 1
        if self.began:
            self.all_began_at = now


def answer(now: float, ranks: list[Local], stacks: dict[int, list[Frame]]) -> dict[str, Any]:
    """This node's post: each live rank's age since its last beat (since its start when it
    never beat), step, phase and innermost frames."""
    found = []
    for r in ranks:
        if not r.alive:
            continue
        beat = r.beat
        frames = stacks.get(r.rank, [])[:MAX_FRAMES]
        found.append(
            {
                "rank": r.rank,
                "age": now - (beat.time if beat is not None else r.started),
                "step": beat.step if beat is not None else -1,
                "phase": beat.phase if beat is not None else "start",
                "frames": [[f.file, f.line, f.function] for f in frames],
            }
        )
    return {"ranks": found}


def judge(
    posts: dict[int, dict[str, Any]],
    nnodes: int,
    name: str,
    startup_timeout: float | None,
    gather_s: float = GATHER_S,
) -> Found:
    """The report every node prints, from every node's post: the ranks that never beat when
    some did not, else the rank furthest behind, with its node, step, phase and line, and what
    the others wait in. Ages are shown as posted (now = 0, each beat ``age`` seconds before)."""
    watches: list[Watch] = []
    stacks: dict[int, list[Frame]] = {}
    for node, post in sorted(posts.items()):
        for r in post.get("ranks", []):
            rank = int(r["rank"])
            watches.append(Watch(rank, -float(r["age"]), int(r["step"]), str(r["phase"]), node))
            stacks[rank] = [Frame(str(f), int(n), str(fn)) for f, n, fn in r["frames"]]
    late = [w for w in watches if w.step < 0]
    if not watches:  # every rank ended as the hang was seen
        said = f"{name}: a rank was seen stuck, but none was still running to report on"
        return Found("hang", -1, 0, None, "no stack", "a rank was seen stuck", said)
    if late:
        stuck = min(late, key=lambda w: (w.time, w.rank))
        report = startup_report(late, watches, stacks, 0.0, name, startup_timeout or 0, nnodes)
    else:
        stuck = furthest_behind(watches)
        report = hang_report(stuck, watches, stacks, 0.0, name, nnodes)
    missing = sorted(set(range(nnodes)) - set(posts))
    if missing:
        listed = ", ".join(str(n) for n in missing)
        report += (
            f"\n  node(s) {listed} did not answer within {gather_s:g} s: their ranks are not shown"
        )
    frames = stacks.get(stuck.rank, [])
    at = user_frame(frames) or (frames[0] if frames else None)
    where = at.show() if at is not None else "no stack"
    who = f"rank {stuck.rank}" + (f" (node {stuck.node})" if nnodes > 1 else "")
    if late:
        text = f"{who} did not start within {startup_timeout or 0:g} s"
        return Found("start", stuck.rank, stuck.node, None, where, text, report)
    text = f"{who} hung at step {stuck.step} (phase {stuck.phase})"
    return Found("hang", stuck.rank, stuck.node, stuck.step, where, text, report)
