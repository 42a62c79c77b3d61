"""What the launchers of several nodes tell each other: one claim wins, posts are read back,
a gather waits for every node and gives up on a missing one."""

from __future__ import annotations

import threading

from gpukit.launch.node_channel import LocalPeers, tcp_peers
from gpukit.launch.ports import free_port


def test_one_machine_claims_once_and_reads_its_own_posts() -> None:
    peers = LocalPeers()
    assert peers.claim("stop") and not peers.claim("stop")
    assert peers.read("x") is None
    peers.post("watch/0", {"ranks": [0, 1]})
    assert peers.gather("watch", timeout=0) == {0: {"ranks": [0, 1]}}


def test_two_nodes_share_claims_posts_and_gathers_through_the_store() -> None:
    port = free_port()
    host = tcp_peers("127.0.0.1", port, 0, 2)
    guest = tcp_peers("127.0.0.1", port, 1, 2)
    assert host.claim("hang") and not guest.claim("hang")
    assert guest.read("hang") is None
    host.post("hang", {"rank": 3, "node": 1})
    assert guest.read("hang") == {"rank": 3, "node": 1}
    later = threading.Timer(0.2, guest.post, args=("watch/1", {"age": 4.5}))
    later.start()
    host.post("watch/0", {"age": 0.1})
    assert host.gather("watch", timeout=20) == {0: {"age": 0.1}, 1: {"age": 4.5}}
    later.join()
    assert guest.gather("missing", timeout=0.2) == {}


def test_a_post_is_visible_to_another_node_as_soon_as_post_returns() -> None:
    # A TCPStore client does not wait for its SET to be stored; without the round trip that
    # post makes, a few of these reads find nothing (about 1 in 200 on an idle machine).
    port = free_port()
    host = tcp_peers("127.0.0.1", port, 0, 2)
    guest = tcp_peers("127.0.0.1", port, 1, 2)
    missed = []
    for i in range(2000):
        host.post(f"seen/{i}", {"i": i})
        if guest.read(f"seen/{i}") != {"i": i}:
            missed.append(i)
    assert missed == []
