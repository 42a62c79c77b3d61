"""What an attempt's launchers tell each other while it runs and when it ends, so that every
node stops together and decides the same.

While it runs (polled with the heartbeats, two reads of the store per wake-up):

- ``failure/{node}``: a node's first failed rank (global rank, node, time_ns, step, phase, the
  first line of its error); the first node to fail also claims ``failure`` and posts it there,
  and every other node then stops its ranks after the grace, as for a failure of its own;
- ``stop``: the first stop request (claimed): ``{"node", "reason"}``, reason ``signal`` (its
  launcher got SIGTERM/SIGINT), ``rank`` (a rank was asked to stop) or ``rescale`` (node 0 saw
  nodes waiting to join an elastic job). Every node relays SIGTERM to its ranks: they save at
  one step (a gpukit Runtime's ranks agree on it through their process group) and exit 143.

When it ends, each node posts ``end/{node}`` (how each of its ranks ended, their last beats,
whether its launcher was signalled, the injected faults that fired there) and gathers every
node's, waiting a bounded time: the job's outcome is computed from all of them alike on every
node (``settle``), so the first failure named and the restart decided are the same everywhere.
A node that posted nothing in time counts as failed, and so does node 0 when its store (which
its launcher hosts) can no longer be reached.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

from gpukit.launch.failures import ErrorRecord, Fault, RankEnd, failures
from gpukit.launch.faults import fired, mark_fired
from gpukit.launch.heartbeat import Beat
from gpukit.launch.node_channel import Peers
from gpukit.launch.restarts import Progress

END_WAIT_S = 60.0  # beyond the stop grace, for the slowest node to report
RESCALE_EVERY_S = 1.0  # how often node 0 asks whether nodes wait to join


class NodeLink:
    """The attempt's line to the other nodes (for one node, posts nobody reads)."""

    def __init__(self, peers: Peers, waiting: Any = None) -> None:
        self.peers = peers
        self.waiting = waiting  # () -> nodes waiting to join; None: never asked
        self.told_failure = False
        self.told_stop = False
        self.next_ask = time.monotonic() + RESCALE_EVERY_S

    @property
    def alone(self) -> bool:
        return self.peers.nnodes == 1

    def tell_failure(self, end: RankEnd) -> None:
        if self.told_failure:
            return
        self.told_failure = True
        error = end.error.first_line if end.error is not None else ""
        record = {
            "rank": end.rank,
            "node": self.peers.node,
            "time_ns": end.failed_at_ns,
            "step": end.step,
            "phase": end.phase,
            "error": error,
        }
        with contextlib.suppress(Exception):  # the store is gone: the end tells that
            self.peers.post(f"failure/{self.peers.node}", record)
            if self.peers.claim("failure"):
                self.peers.post("failure", record)

    def tell_stop(self, reason: str) -> None:
        if self.told_stop:
            return
        self.told_stop = True
        with contextlib.suppress(Exception):
            if self.peers.claim("stop"):
                self.peers.post("stop", {"node": self.peers.node, "reason": reason})

    def news(self, healthy: bool) -> str | None:
        """``failure`` or ``stop`` from another node (or ``rescale``: node 0 makes room for
        nodes waiting to join), None when there is nothing new."""
        if self.alone:
            return self._rescale(healthy)
        try:
            return self._news(healthy)
        except Exception:  # node 0's launcher, which hosts the store, is gone
            if self.told_failure:
                return None
            self.told_failure = True
            return "failure"

    def _news(self, healthy: bool) -> str | None:
        me = self.peers.node
        failure = None if self.told_failure else self.peers.read("failure")
        if failure is not None and failure.get("node") != me:
            self.told_failure = True
            return "failure"
        stop = None if self.told_stop else self.peers.read("stop")
        if stop is not None and stop.get("node") != me:
            self.told_stop = True
            return "stop"
        return self._rescale(healthy)

    def _rescale(self, healthy: bool) -> str | None:
        if not healthy or self.waiting is None or self.peers.node != 0:
            return None
        if time.monotonic() < self.next_ask or self.told_stop:
            return None
        self.next_ask = time.monotonic() + RESCALE_EVERY_S
        if self.waiting() > 0:
            self.tell_stop("rescale")
            return "rescale"
        return None


def settle(
    outcome: Any, peers: Peers, folder: Path, signalled: bool, wait: float, attempt: int
) -> Any:
    """The job's outcome of the attempt, from every node's report (``outcome`` unchanged for
    one node); injected faults that fired on any node are marked fired on this one too."""
    if peers.nnodes == 1:
        stop = peers.read("stop")
        if outcome.status == "preempted" and not signalled and _rescaled(stop):
            return dataclasses.replace(outcome, status="rescale")
        return outcome
    progress: Progress = outcome.progress
    mine = {
        "status": outcome.status,
        "signalled": signalled,
        "stopping": outcome.stopping,
        "ends": [_end_json(e) for e in outcome.ends],
        "beats": [dataclasses.asdict(b) for b in progress.last.values()],
        "first_beat": {str(r): t for r, t in progress.first_beat.items()},
        "started": progress.started,
        "first_step_at": progress.first_step_at,
        "fault": dataclasses.asdict(outcome.fault) if outcome.fault else None,
        "detected_at": outcome.detected_at,
        "stopped_at": outcome.stopped_at,
        "message": outcome.preempted_message,
        "fired": fired(folder),
    }
    try:
        peers.post(f"end/{peers.node}", mine)
        reports = peers.gather("end", wait + END_WAIT_S)
        stop = peers.read("stop")
    except Exception:  # node 0's launcher, which hosts the store, is gone
        reports, stop = {peers.node: mine}, None
    mark_fired(folder, sorted({name for r in reports.values() for name in r["fired"]}))
    return _merged(outcome, reports, peers.nnodes, stop, attempt)


def _merged(
    local: Any, reports: dict[int, dict[str, Any]], nnodes: int, stop: Any, attempt: int
) -> Any:
    ends = sorted((_end_from(e) for r in reports.values() for e in r["ends"]), key=lambda e: e.rank)
    ranks = len(ends) * nnodes // max(len(reports), 1)
    progress = Progress(min(r["started"] for r in reports.values()), ranks)
    for report in reports.values():
        for beat in report["beats"]:
            progress.last[int(beat["rank"])] = Beat(**beat)
        progress.first_beat.update({int(k): v for k, v in report["first_beat"].items()})
    steps = [r["first_step_at"] for r in reports.values() if r["first_step_at"] is not None]
    progress.first_step_at = min(steps) if steps else None
    detected = [r["detected_at"] for r in reports.values() if r["detected_at"] is not None]
    stopped = max((r["stopped_at"] or 0.0) for r in reports.values())
    merged = dataclasses.replace(
        local,
        ends=ends,
        progress=progress,
        stopped_at=stopped,
        detected_at=min(detected) if detected else None,
    )
    missing = sorted(set(range(nnodes)) - set(reports))
    hung = [r for r in reports.values() if r["status"] == "hung" and r["fault"]]
    signalled = any(r["signalled"] for r in reports.values())
    stopping = any(r["stopping"] for r in reports.values())
    failed = failures(ends)
    stop_only = stopping and all(e.consequence for e in failed)
    if missing:
        text = f"node {missing[0]}'s launcher sent no report (it died, or lost the network)"
        fault = Fault("lost", -1 - missing[0], "no report", None, text, attempt)
        return dataclasses.replace(merged, status="failed", fault=fault, lost=text)
    if hung:
        first = min(hung, key=lambda r: r["detected_at"] or 0.0)
        return dataclasses.replace(merged, status="hung", fault=Fault(**first["fault"]))
    if failed and not signalled and not stop_only:
        fault = failed[0].fault(attempt, ends)
        return dataclasses.replace(
            merged, status="failed", fault=fault, detected_at=failed[0].failed_at_ns / 1e9
        )
    if signalled or any(e.preempted for e in ends):
        if not signalled and _rescaled(stop):
            return dataclasses.replace(merged, status="rescale", fault=None)
        said = next((r["message"] for _, r in sorted(reports.items()) if r["message"]), None)
        return dataclasses.replace(merged, status="preempted", fault=None, preempted_message=said)
    return dataclasses.replace(merged, status="ok", fault=None)


def _rescaled(stop: dict[str, Any] | None) -> bool:
    return stop is not None and stop.get("reason") == "rescale"


def _end_json(end: RankEnd) -> dict[str, Any]:
    data = dataclasses.asdict(end)
    data["error"] = dataclasses.asdict(end.error) if end.error is not None else None
    return data


def _end_from(data: dict[str, Any]) -> RankEnd:
    error = data.get("error")
    fields = {**data, "error": ErrorRecord(**error) if error is not None else None}
    return RankEnd(**fields)
