"""The end of an attempt over several nodes: every node gathers every node's report and reaches
the same outcome (the first failure across nodes, the faults fired anywhere); a node that sends
nothing counts as failed. Two nodes' launchers in threads, over a TCPStore on 127.0.0.1."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from gpukit.launch import node_messages
from gpukit.launch.attempt_watch import Outcome
from gpukit.launch.failures import ErrorRecord, RankEnd, headline
from gpukit.launch.node_channel import tcp_peers
from gpukit.launch.node_messages import settle
from gpukit.launch.ports import free_port
from gpukit.launch.restarts import Progress


def _outcome(end: RankEnd, status: str) -> Outcome:
    return Outcome(status, [end], Progress(100.0, 1), stopped_at=3.0)


def test_every_node_names_the_same_first_failure_and_shares_the_faults_fired(
    tmp_path: Path,
) -> None:
    port = free_port()
    peers = [tcp_peers("127.0.0.1", port, node, 2) for node in (0, 1)]
    folders = [tmp_path / "node0", tmp_path / "node1"]
    for folder in folders:
        folder.mkdir()
    (folders[1] / "fault-0.fired").touch()  # rank 1's injected fault fired on node 1
    victim = ErrorRecord("RuntimeError: Connection closed by peer", 2_000)
    outcomes = [
        _outcome(RankEnd(0, 1, 2_100, victim, step=5, phase="backward"), "failed"),
        _outcome(RankEnd(1, -9, 1_000, step=5, phase="forward"), "failed"),
    ]
    merged: dict[int, Any] = {}

    def end(node: int) -> None:
        merged[node] = settle(outcomes[node], peers[node], folders[node], False, 5.0, 0)

    threads = [threading.Thread(target=end, args=(node,)) for node in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(merged) == [0, 1]
    for outcome in merged.values():
        assert outcome.status == "failed"
        assert outcome.fault.rank == 1 and outcome.fault.kind == "killed"
        assert [e.rank for e in outcome.ends] == [0, 1]
    assert headline(merged[0].ends, "x") == headline(merged[1].ends, "x")
    assert headline(merged[0].ends, "x").startswith("x: rank 1 was killed by SIGKILL at step 5")
    assert (folders[0] / "fault-0.fired").exists()  # it fires once per job, on any node


def test_a_node_that_sends_no_report_fails_the_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_messages, "END_WAIT_S", 0.2)
    port = free_port()
    alone = tcp_peers("127.0.0.1", port, 0, 2)
    outcome = settle(_outcome(RankEnd(0, 0, 1_000), "ok"), alone, tmp_path, False, 0.0, 3)
    assert outcome.status == "failed"
    assert outcome.lost == "node 1's launcher sent no report (it died, or lost the network)"
    assert outcome.fault.attempt == 3
