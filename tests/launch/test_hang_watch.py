"""The hang watch's clocks and its protocol across nodes, in-process with made-up times: a rank
is watched from its first beat once every rank has beaten, start-up has a bound of its own, and
every node of a job reports the same stuck rank (two nodes' launchers on one TCPStore)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from gpukit import _env
from gpukit.errors import ConfigError
from gpukit.launch import run_job
from gpukit.launch.hang_reports import Frame
from gpukit.launch.hang_watch import Found, HangWatch, Local, judge
from gpukit.launch.heartbeat import Beat
from gpukit.launch.node_channel import LocalPeers, StorePeers, tcp_peers
from gpukit.launch.ports import free_port

C10D = os.path.join(os.path.dirname(torch.__file__), "distributed", "distributed_c10d.py")
STALL = [Frame("train.py", 9, "stall"), Frame("train.py", 30, "main")]
WAITS = [Frame(C10D, 2500, "all_reduce"), Frame("train.py", 21, "main")]
IMPORTS = [
    Frame("<frozen importlib._bootstrap>", 1, "_find_and_load"),
    Frame("slow.py", 3, "<module>"),
]


def beat(rank: int, at: float, step: int, phase: str) -> Beat:
    return Beat(rank, at, step, -1, 0, phase, False, 0)


def no_dump() -> dict[int, list[Frame]]:
    raise AssertionError("nothing is stuck: no rank may be asked for its stack")


def dumps(stacks: dict[int, list[Frame]]) -> Any:
    return lambda: stacks


def test_a_rank_that_beat_is_not_blamed_while_a_peer_is_still_importing() -> None:
    watch = HangWatch(LocalPeers(), hang_timeout=3, startup_timeout=900, name="gpukit launch")
    # Rank 0 beat at 1 s and waits for rank 1 in the rendezvous; rank 1 still imports torch.
    waiting = [Local(0, 0.0, beat(0, 1.0, 0, "start")), Local(1, 0.0, None)]
    for now in (2.0, 50.0, 500.0, 899.0):
        assert watch.check(now, waiting, no_dump) is None
    # Rank 1 beats at 890 s: from then on both are watched, rank 0's old beat no older than that.
    started = [Local(0, 0.0, beat(0, 1.0, 0, "start")), Local(1, 0.0, beat(1, 890.0, 0, "start"))]
    assert watch.check(891.0, started, no_dump) is None
    assert watch.check(893.5, started, no_dump) is None  # 2.5 s: within the hang timeout
    # Neither beats again: a hang, and rank 0 (the oldest beat at the same place) is named.
    found = watch.check(895.0, started, dumps({0: STALL, 1: WAITS}))
    assert found is not None and found.kind == "hang" and found.rank == 0


def test_a_rank_that_never_beats_is_named_after_the_startup_timeout() -> None:
    watch = HangWatch(LocalPeers(), hang_timeout=3, startup_timeout=900, name="gpukit launch")
    ranks = [Local(0, 0.0, beat(0, 1.0, 0, "start")), Local(1, 0.0, None)]
    assert watch.check(899.0, ranks, no_dump) is None
    found = watch.check(901.0, ranks, dumps({0: WAITS, 1: IMPORTS}))
    assert found is not None
    assert (found.kind, found.rank, found.step, found.where) == (
        "start",
        1,
        None,
        "slow.py:3 in <module>",
    )
    assert found.text == "rank 1 did not start within 900 s"
    lines = found.report.splitlines()
    assert lines[0] == (
        "gpukit launch: rank 1 did not start: no heartbeat in the 901 s since it started "
        "(start-up timeout 900 s), at slow.py:3 in <module> (innermost: "
        "<frozen importlib._bootstrap>:1 in _find_and_load)"
    )
    assert lines[1].startswith("  rank 0: waits in all_reduce (")
    assert lines[1].endswith(
        "called from train.py:21 in main; last beat 900 s ago at step 0 (phase start)"
    )


def test_every_rank_that_never_beat_is_named() -> None:
    watch = HangWatch(LocalPeers(), hang_timeout=None, startup_timeout=60, name="x")
    ranks = [Local(0, 0.0, beat(0, 1.0, 0, "start")), Local(1, 0.0, None), Local(2, 5.0, None)]
    found = watch.check(70.0, ranks, dumps({1: IMPORTS, 2: IMPORTS}))
    assert found is not None and found.rank == 1
    assert (
        "  rank 2: did not start either: no heartbeat in the 65 s since it started, at slow.py:3"
        in found.report
    )
    assert (
        "  rank 0: (no stack dump: its process did not write one); last beat 69 s ago"
        in found.report
    )


@pytest.mark.parametrize(("hang", "startup"), [(3.0, None), (None, None), (0.0, 0.0)])
def test_a_job_without_beats_or_without_bounds_is_not_watched(
    hang: float | None, startup: float | None
) -> None:
    unbeaten = HangWatch(LocalPeers(), hang_timeout=3, startup_timeout=60, name="x")
    never = [Local(0, 0.0, None), Local(1, 0.0, None)]  # a script without a gpukit Runtime
    assert unbeaten.check(10_000.0, never, no_dump) is None
    watch = HangWatch(LocalPeers(), hang_timeout=hang, startup_timeout=startup, name="x")
    ranks = [Local(0, 0.0, beat(0, 1.0, 0, "start")), Local(1, 0.0, None)]
    assert watch.check(10_000.0, ranks, no_dump) is None


def test_one_machine_reports_a_hang_as_before_without_nodes() -> None:
    watch = HangWatch(LocalPeers(), hang_timeout=3, startup_timeout=900, name="gpukit launch")
    ranks = [Local(0, 0.0, beat(0, 9.0, 3, "collective")), Local(1, 0.0, beat(1, 8.0, 3, "loop"))]
    assert watch.check(10.0, ranks, no_dump) is None
    found = watch.check(13.5, ranks, dumps({0: WAITS, 1: STALL}))
    assert found is not None and (found.kind, found.rank, found.step) == ("hang", 1, 3)
    assert found.text == "rank 1 hung at step 3 (phase loop)"
    head, other = found.report.splitlines()
    assert head == (
        "gpukit launch: rank 1 hung: no heartbeat for 6 s at step 3 (phase loop), at "
        "train.py:9 in stall"
    )
    assert other.startswith("  rank 0: waits in all_reduce (") and "node" not in found.report


def two_nodes() -> tuple[StorePeers, StorePeers]:
    port = free_port()
    return tcp_peers("127.0.0.1", port, 0, 2), tcp_peers("127.0.0.1", port, 1, 2)


def both(
    first: HangWatch, first_args: tuple[Any, ...], second: HangWatch, second_args: tuple[Any, ...]
) -> tuple[Found | None, Found | None]:
    """``first.check`` in a thread (it claims and gathers), ``second.check`` here until it
    answers: the second node sees the claim at one of its wake-ups."""
    found: list[Found | None] = []
    thread = threading.Thread(target=lambda: found.append(first.check(*first_args)))
    thread.start()
    mine = None
    for _ in range(400):  # wake-ups; the gather waits 20 s at most
        mine = second.check(*second_args)
        if mine is not None:
            break
        time.sleep(0.05)
    thread.join(timeout=60)
    assert not thread.is_alive() and found
    return found[0], mine


def test_a_rank_on_node_1_that_stopped_beating_is_named_by_both_nodes() -> None:
    peers0, peers1 = two_nodes()
    node0 = HangWatch(peers0, hang_timeout=3, startup_timeout=900, name="gpukit launch")
    node1 = HangWatch(peers1, hang_timeout=3, startup_timeout=900, name="gpukit launch")
    ranks0 = [Local(0, 0.0, beat(0, 9.0, 0, "loop")), Local(1, 0.0, beat(1, 9.0, 0, "loop"))]
    ranks1 = [Local(2, 50.0, beat(2, 59.0, 0, "loop")), Local(3, 50.0, beat(3, 59.0, 0, "loop"))]
    # Each node learns that every rank of the job has begun (clocks differ between machines).
    assert node0.check(10.0, ranks0, no_dump) is None
    assert node1.check(60.0, ranks1, no_dump) is None
    assert node0.check(11.5, ranks0, no_dump) is None
    assert node0.all_began_at == 11.5 and node1.all_began_at == 60.0
    # Rank 3 stops beating at step 3; the others wait for it in the collective.
    ranks0 = [
        Local(0, 0.0, beat(0, 18.0, 3, "collective")),
        Local(1, 0.0, beat(1, 18.5, 3, "collective")),
    ]
    ranks1 = [
        Local(2, 50.0, beat(2, 68.0, 3, "collective")),
        Local(3, 50.0, beat(3, 62.0, 3, "loop")),
    ]
    assert node0.check(19.0, ranks0, no_dump) is None  # node 0 sees nothing wrong itself
    seen1, seen0 = both(
        node1,
        (70.0, ranks1, dumps({2: WAITS, 3: STALL})),
        node0,
        (19.5, ranks0, dumps({0: WAITS, 1: WAITS})),
    )
    assert seen0 is not None and seen1 is not None
    assert seen0.report == seen1.report and seen0.text == seen1.text
    assert (seen0.rank, seen0.node, seen0.step, seen0.where) == (3, 1, 3, "train.py:9 in stall")
    assert seen0.text == "rank 3 (node 1) hung at step 3 (phase loop)"
    lines = seen0.report.splitlines()
    assert lines[0] == (
        "gpukit launch: rank 3 (node 1) hung: no heartbeat for 8 s at step 3 (phase loop), at "
        "train.py:9 in stall"
    )
    assert [line.split(":")[0] for line in lines[1:]] == [
        "  rank 0 (node 0)",
        "  rank 1 (node 0)",
        "  rank 2 (node 1)",
    ]
    assert lines[1].endswith(
        "called from train.py:21 in main; last beat 2 s ago at step 3 (phase collective)"
    )
    assert peers0.read("hang") == {"kind": "hang", "node": 1, "ranks": [3]}


def test_a_node_whose_ranks_never_beat_is_named_and_the_waiting_node_is_not_blamed() -> None:
    peers0, peers1 = two_nodes()
    node0 = HangWatch(peers0, hang_timeout=3, startup_timeout=900, name="gpukit launch")
    node1 = HangWatch(peers1, hang_timeout=3, startup_timeout=900, name="gpukit launch")
    ranks0 = [Local(0, 0.0, beat(0, 5.0, 0, "start")), Local(1, 0.0, beat(1, 5.0, 0, "start"))]
    ranks1 = [Local(2, 100.0, None), Local(3, 100.0, None)]  # still importing on node 1
    assert node0.check(6.0, ranks0, no_dump) is None
    assert node1.check(101.0, ranks1, no_dump) is None
    assert node1.began and node1.all_began_at is None  # node 0's ranks beat: node 1 is watched
    # Node 0's ranks wait in the rendezvous far past the hang timeout: not a hang of theirs.
    assert node0.check(800.0, ranks0, no_dump) is None
    seen1, seen0 = both(
        node1,
        (1001.0, ranks1, dumps({2: IMPORTS, 3: IMPORTS})),
        node0,
        (900.0, ranks0, dumps({0: WAITS, 1: WAITS})),
    )
    assert seen0 is not None and seen1 is not None and seen0.report == seen1.report
    assert (seen0.kind, seen0.rank, seen0.node) == ("start", 2, 1)
    assert seen0.text == "rank 2 (node 1) did not start within 900 s"
    lines = seen0.report.splitlines()
    assert lines[0].startswith(
        "gpukit launch: rank 2 (node 1) did not start: no heartbeat in the 901 s since it "
        "started (start-up timeout 900 s), at slow.py:3 in <module>"
    )
    assert lines[1].startswith("  rank 3 (node 1): did not start either: no heartbeat in the 901 s")
    assert lines[2].startswith("  rank 0 (node 0): waits in all_reduce (")
    assert lines[2].endswith("last beat 895 s ago at step 0 (phase start)")


def test_only_the_first_node_to_see_a_hang_leads_and_a_silent_node_is_said() -> None:
    peers0, peers1 = two_nodes()
    assert peers1.claim("hang")  # node 1 saw it first, then went silent
    node0 = HangWatch(peers0, hang_timeout=3, startup_timeout=None, name="x", gather_s=0.3)
    node0.began, node0.all_began_at = True, 0.0
    ranks0 = [Local(0, 0.0, beat(0, 1.0, 2, "forward"))]
    found = node0.check(10.0, ranks0, dumps({0: STALL}))
    assert found is not None and found.rank == 0
    assert peers0.read("hang") is None  # it lost the claim: it posts only its own answer
    assert found.report.endswith(
        "  node(s) 1 did not answer within 0.3 s: their ranks are not shown"
    )


def test_the_report_is_computed_from_the_posts_alone() -> None:
    posts = {
        1: {"ranks": [{"rank": 1, "age": 7.2, "step": 4, "phase": "loop", "frames": []}]},
        0: {"ranks": [{"rank": 0, "age": 0.4, "step": 4, "phase": "collective", "frames": []}]},
    }
    found = judge(posts, 2, "x", 900)
    assert found.report.splitlines()[0] == (
        "x: rank 1 (node 1) hung: no heartbeat for 7 s at step 4 (phase loop) (no stack dump: "
        "its process did not write one)"
    )
    assert found.where == "no stack"


@pytest.mark.parametrize("given", [-1.0, float("nan"), float("inf")])
def test_run_job_refuses_a_startup_timeout_that_is_not_seconds(given: float) -> None:
    with pytest.raises(ConfigError, match=r"startup_timeout=.*: give seconds >= 0 \(0: never\)"):
        run_job(["true"], 1, startup_timeout=given)


@pytest.mark.parametrize(("value", "seconds"), [("", 900.0), ("0", 0.0), ("60", 60.0)])
def test_the_startup_timeout_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, value: str, seconds: float
) -> None:
    monkeypatch.setenv("GPUKIT_STARTUP_TIMEOUT", value)
    assert _env.startup_timeout() == seconds


@pytest.mark.parametrize("value", ["-1", "soon", "inf", "٣٠"])
def test_a_startup_timeout_variable_that_is_not_seconds_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GPUKIT_STARTUP_TIMEOUT", value)
    with pytest.raises(ConfigError, match="GPUKIT_STARTUP_TIMEOUT="):
        _env.startup_timeout()
