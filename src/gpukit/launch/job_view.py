"""The launcher's view of a running job, refreshed about once a second: every rank's figures
(``rank_stats``, ``gpu_watch``), stragglers named (``stragglers``, judged on node 0 for the
whole job), ``JOB/live.json`` rewritten whole, and the records of ``job_records``.

The attempt's watch wakes every 0.15 s; the view does its work at most once a second
(:data:`EVERY_S`), from the beats the watch has read already: no rank is asked anything.

Several nodes: each node posts ``watch/<node>`` (its ranks' records and a counter that moves at
every post; node 0's also holds the stragglers it judged) through the attempt's ``Peers`` and
reads every other node's. A node whose counter has not moved for :data:`STALE_S` seconds is
stale: its last ranks are kept, marked so, with a note. Store traffic, per node and second: one
post (a set and a check) and ``nnodes - 1`` reads (a check and a get each): a few requests a
second for a few nodes, ``2 * nnodes`` per node for many; one machine uses no store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Protocol

from gpukit.launch import rank_stats
from gpukit.launch.gpu_watch import GpuWatch
from gpukit.launch.job_records import JobRecord
from gpukit.launch.node_channel import Peers
from gpukit.launch.rank_stats import RankStats
from gpukit.launch.restarts import Progress
from gpukit.launch.stragglers import Seen, Stragglers
from gpukit.launch.workers import Worker

EVERY_S = 1.0  # between two refreshes of the view
STALE_S = 5.0  # a node whose post has not moved for this long is stale


class Viewed(Protocol):
    """What the view reads of the attempt (``supervisor.Attempt`` has it)."""

    @property
    def number(self) -> int: ...
    @property
    def workers(self) -> list[Worker]: ...
    @property
    def peers(self) -> Peers: ...


class JobView:
    """One attempt's view of the job (see the module docstring)."""

    def __init__(
        self,
        record: JobRecord,
        attempt: Viewed,
        nproc: int,
        visible: str | None,
        say: Callable[[str], None],
        gpus: GpuWatch | None = None,
    ) -> None:
        self.record = record
        self.attempt = attempt
        self.nproc = nproc
        self.say = say  # prints one line to the launcher's output, its name in front
        self.gpus = gpus if gpus is not None else GpuWatch(visible)
        self.detector = Stragglers(record.straggler_factor, record.straggler_steps)
        self.stats: dict[int, RankStats] = {}
        self._at = -EVERY_S
        self._counter = 0
        self._heard: dict[int, tuple[int, float, dict[str, Any]]] = {}  # node: counter, when

    def tick(self, now: float, progress: Progress) -> None:
        """Refresh the view when a second has passed since the last refresh."""
        if now - self._at < EVERY_S:
            return
        self._at = now
        own = self._own_ranks(now, progress)
        peers = self.attempt.peers
        nodes: list[dict[str, Any]] = [
            {"node": peers.node, "host": self.record.host, "age_s": 0.0, "stale": False, "note": ""}
        ]
        ranks: list[dict[str, Any]] = list(own)
        stragglers: list[dict[str, Any]] = []
        if peers.nnodes > 1:
            others, nodes_heard, stragglers = self._hear(now)
            ranks += others
            nodes += nodes_heard
        rank_stats.add_shares(ranks)
        if peers.node == 0:
            stragglers = self._judge(ranks, now)
        if peers.nnodes > 1:
            self._post(own, stragglers)
        ranks.sort(key=lambda r: r["rank"])
        nodes.sort(key=lambda n: n["node"])
        self.record.write_live(self._live(now, ranks, nodes, stragglers, progress))
        self.record.sample(now, self.attempt.number, ranks)

    def _own_ranks(self, now: float, progress: Progress) -> list[dict[str, Any]]:
        pids = {w.pid for w in self.attempt.workers}
        found = []
        for w in self.attempt.workers:
            stats = self.stats.setdefault(w.rank, RankStats(w.rank))
            beat = progress.last.get(w.rank)
            if beat is not None and (stats.beat is None or beat.time > stats.beat.time):
                stats.observe(beat)
            found.append(self._rank(w, stats, now, pids))
        return found

    def _rank(self, w: Worker, stats: RankStats, now: float, pids: set[int]) -> dict[str, Any]:
        beat, window = stats.beat, stats.window
        gpu, note = (None, "")
        if beat is not None:
            gpu, note = self.gpus.read(beat.device, pids, now)
        median = stats.step_s_median
        return {
            "rank": w.rank,
            "node": self.attempt.peers.node,
            "host": self.record.host,
            "local_rank": w.rank - self.attempt.peers.node * self.nproc,
            "pid": w.pid,
            "alive": w.alive,
            "step": beat.step if beat is not None else None,
            "phase": beat.phase if beat is not None else None,
            "where": beat.where if beat is not None else "",
            "beat_age_s": round(now - beat.time, 3) if beat is not None else None,
            "step_s": beat.last_step_s or None if beat is not None else None,
            "step_s_median": median,
            "samples_per_s": stats.samples_per_s(),
            "own_s": window.own_s if window is not None else None,
            "window_s": window.step_s if window is not None else None,
            "phases_s": window.phases_s if window is not None else None,
            "shares": None,
            "memory": rank_stats.memory(beat, w.pid if w.alive else None),
            "gpu": gpu,
            "gpu_note": note,
        }

    def _judge(self, ranks: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """Node 0: name stragglers and recoveries, say and record each."""
        seen = [s for r in ranks if r.get("alive") and (s := Seen.of(r)) is not None]
        for event in self.detector.judge(seen, self.attempt.number, now):
            self.say(event["text"])
            self.record.event(event, self.attempt.number)
        return self.detector.now_slow

    def _post(self, own: list[dict[str, Any]], stragglers: list[dict[str, Any]]) -> None:
        self._counter += 1
        post = {"counter": self._counter, "host": self.record.host, "ranks": own}
        if self.attempt.peers.node == 0:
            post["stragglers"] = stragglers
        # The store gone with a node is the attempt's watch's to say, not the view's.
        with contextlib.suppress(Exception):
            self.attempt.peers.post(f"watch/{self.attempt.peers.node}", post)

    def _hear(
        self, now: float
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        """The other nodes' ranks (the last heard from a stale node), the nodes' state, and
        node 0's stragglers."""
        peers = self.attempt.peers
        ranks: list[dict[str, Any]] = []
        nodes: list[dict[str, Any]] = []
        stragglers: list[dict[str, Any]] = []
        for node in range(peers.nnodes):
            if node == peers.node:
                continue
            try:
                post = peers.read(f"watch/{node}")
            except Exception:
                post = None
            before = self._heard.get(node)
            if post is not None and (before is None or post["counter"] != before[0]):
                self._heard[node] = (post["counter"], now, post)
            heard = self._heard.get(node)
            if heard is None:
                nodes.append(
                    {
                        "node": node,
                        "host": "",
                        "age_s": None,
                        "stale": False,
                        "note": "not heard from yet",
                    }
                )
                continue
            _, at, last = heard
            age = now - at
            stale = age > STALE_S
            note = f"no news for {age:.0f} s: its ranks as last heard" if stale else ""
            nodes.append(
                {
                    "node": node,
                    "host": last.get("host", ""),
                    "age_s": round(age, 1),
                    "stale": stale,
                    "note": note,
                }
            )
            ranks += [{**r, "stale": True} if stale else r for r in last.get("ranks", [])]
            if node == 0:
                stragglers = list(last.get("stragglers", []))
        return ranks, nodes, stragglers

    def _live(
        self,
        now: float,
        ranks: list[dict[str, Any]],
        nodes: list[dict[str, Any]],
        stragglers: list[dict[str, Any]],
        progress: Progress,
    ) -> dict[str, Any]:
        record, peers = self.record, self.attempt.peers
        steps = [r["step"] for r in ranks if r.get("step") is not None]
        step = min(steps) if steps else None
        rates = [r["samples_per_s"] for r in ranks if r.get("samples_per_s")]
        medians = [r["step_s_median"] for r in ranks if r.get("step_s_median")]
        eta = None
        if record.total_steps is not None and step is not None and medians:
            eta = round(max(record.total_steps - step, 0) * max(medians), 1)
        notes = sorted({r["gpu_note"] for r in ranks if r.get("gpu_note")})
        notes += [f"node {n['node']}: {n['note']}" for n in nodes if n["note"]]
        return {
            "version": 1,
            "name": self.record.name,
            "command": record.command,
            "host": record.host,
            "launcher_pid": os.getpid(),
            "job_dir": str(record.folder),
            "out": str(record.out) if record.out is not None else None,
            "node": peers.node,
            "nnodes": peers.nnodes,
            "nproc": self.nproc,
            "world_size": self.nproc * peers.nnodes,
            "attempt": self.attempt.number,
            "restarts": record.restarts,
            "started": record.started,
            "updated": now,
            "ended": record.ended,
            "step": step,
            "total_steps": record.total_steps,
            "samples_per_s": round(sum(rates), 1) if rates else None,
            "eta_s": eta,
            "checkpoint": self._checkpoint(progress),
            "ranks": ranks,
            "nodes": nodes,
            "stragglers": stragglers,
            "events": list(record.events),
            "notes": notes,
        }

    def _checkpoint(self, progress: Progress) -> dict[str, Any] | None:
        step = max(self.record.checkpoint, progress.checkpoint)
        if step < 0:
            return None
        path = None
        if self.record.out is not None:
            # The checkpoint package's folder name (a lower layer cannot import it).
            folder = self.record.out / "checkpoints" / f"step-{step:08d}"
            path = str(folder.resolve()) if folder.is_dir() else None
        return {"step": step, "path": path}

    def close(self) -> None:
        self.gpus.close()
