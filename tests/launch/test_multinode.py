"""One job over several nodes: each node a `gpukit launch --nnodes N --node-rank i` of its own,
all on this machine (1 process per node), meeting through torch's c10d rendezvous at
127.0.0.1. A failure anywhere restarts every node, named alike on every node; a stop on one
node stops all, saving once; a node that never comes ends in a clear error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from gpukit.launch.ports import free_port
from tests.cli.test_launch import SCRIPT as PLAIN  # rank FAIL_RANK raises after a collective
from tests.launch.test_agent_jobs import HANG

# Signals, grace periods and rendezvous: one at a time under `make test`.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("timing")]

SRC = str(Path(__file__).resolve().parents[2] / "src")
PERIODIC = 4  # checkpoints every 4 steps

# A gpukit Runtime's loop, each step a little slow; argv[1]: steps.
PROGRAM = """
import os, sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import gpukit as gk

steps = int(sys.argv[1])
rt = gk.Runtime(checkpoints="ck", save_every=PERIODIC, seed=0, resume="auto")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
model, opt, loader = rt.setup(model, opt, DataLoader(data, batch_size=8, shuffle=True))
while rt.global_step < steps:
    for x, y in loader:
        time.sleep(0.05)
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
        if rt.global_step >= steps:
            break
rt.teardown()
""".replace("PERIODIC", str(PERIODIC))


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPUKIT_JOB_DIR", "GPUKIT_FAULT"):
        env.pop(name, None)
    return {**env, **extra}


def _node(
    rank: int, nnodes: int | str, port: int, cwd: Path, args: list[str], nproc: int = 1, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpukit",
            "launch",
            "--nproc",
            str(nproc),
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            *args,
        ],
        cwd=cwd,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _job(nnodes: int, cwd: Path, args: list[str], **env: str) -> list[subprocess.Popen[str]]:
    port = free_port()
    return [_node(r, nnodes, port, cwd, args, **env) for r in range(nnodes)]


def _ends(nodes: list[subprocess.Popen[str]], timeout: float = 400) -> list[str]:
    """Every node's output once it ended (a hang guard only: a timeout fails the test)."""
    outputs = []
    for node in nodes:
        try:
            outputs.append(node.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail(f"a node did not end:\n{node.communicate()[0]}")
    return outputs


def _weights(folder: Path) -> dict[str, object]:
    newest = folder / "ck" / (folder / "ck" / "latest").read_text().strip()
    return load_file(str(newest / "model.safetensors"))


def test_a_rank_killed_on_node_1_restarts_every_node_and_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    steps = "8"  # killed at step 6, resumed from the save at step 4: 2 steps redone, 2 new
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for folder in (whole, cut):
        folder.mkdir()
        (folder / "train.py").write_text(PROGRAM)
    # The same two ranks on one node, uninterrupted.
    plain = subprocess.run(
        [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", "train.py", steps],
        cwd=whole,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    nodes = _job(2, cut, ["--max-restarts", "2", "train.py", steps], GPUKIT_FAULT="sigkill:1:6")
    outputs = _ends(nodes)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    for output in outputs:
        # Every node restarted once, after the same failure: the fault fired once in the job.
        assert "restart 1/2 after rank 1 was killed by SIGKILL" in output, output
        assert "restart 2/2" not in output, output
    weights, expected = _weights(cut), _weights(whole)
    assert weights.keys() == expected.keys()
    assert all(weights[k].equal(expected[k]) for k in weights)  # type: ignore[attr-defined]


def test_a_raise_on_node_1_is_named_first_on_every_node(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(PLAIN)
    nodes = _job(3, tmp_path, ["plain.py", "."], FAIL_RANK="1")
    outputs = _ends(nodes)
    assert [n.returncode for n in nodes] == [1, 1, 1], outputs
    for output in outputs:
        assert re.search(
            r"gpukit launch: rank 1 raised RuntimeError: rank 1 gives up — the first failure; "
            r"rank 0 (failed after it|stopped), rank 2 (failed after it|stopped)\n",
            output,
        ), output


def test_sigterm_to_node_1_stops_every_node_saving_once(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(PROGRAM)
    nodes = _job(2, tmp_path, ["--max-restarts", "2", "train.py", "400"])
    first = tmp_path / "ck" / f"step-{PERIODIC:08d}" / "manifest.json"
    deadline = time.monotonic() + 300
    while not first.exists():
        if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
            for node in nodes:
                node.kill()
            pytest.fail("no first checkpoint:\n" + "\n".join(n.communicate()[0] for n in nodes))
        time.sleep(0.1)
    nodes[1].send_signal(signal.SIGTERM)
    outputs = _ends(nodes)
    assert [n.returncode for n in nodes] == [143, 143], outputs
    saved = (tmp_path / "ck" / "latest").read_text().strip()
    step = int(saved.removeprefix("step-"))
    assert step > PERIODIC, outputs  # the stop's own save, past the periodic one
    past = [p.name for p in (tmp_path / "ck").glob("step-*") if int(p.name[5:]) > PERIODIC]
    assert past == [saved], outputs  # saved once, for the whole job
    for output in outputs:  # every node says where the job saved
        said = re.findall(r"stopped after step (\d+) on every rank and saved", output)
        assert said == [str(step)], output
    assert all("restart" not in output for output in outputs), outputs


@pytest.mark.parametrize("rank", [0, 1])  # node 0 hosts the meeting point, node 1 does not
def test_a_node_that_never_joins_ends_in_a_clear_error(tmp_path: Path, rank: int) -> None:
    (tmp_path / "plain.py").write_text(PLAIN)
    port = free_port()
    # 1 s: the error, not the wait, is the point (node 1 waits a few times that to reach node 0).
    alone = _node(rank, 2, port, tmp_path, ["plain.py", "."], GPUKIT_RENDEZVOUS_TIMEOUT="1")
    output = _ends([alone], timeout=200)[0]
    assert alone.returncode != 0, output
    assert f"node {rank} waited 1 s at 127.0.0.1:{port} for 2 nodes to join, in vain" in output
    assert "the same --nnodes, --master-addr and --master-port" in output
    assert "GPUKIT_RENDEZVOUS_TIMEOUT=SECONDS waits longer" in output
    assert "Traceback" not in output


def test_nodes_with_different_process_counts_are_refused(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(PLAIN)
    port = free_port()
    nodes = [_node(r, 2, port, tmp_path, ["plain.py", "."], nproc=1 + r) for r in (0, 1)]
    outputs = _ends(nodes, timeout=200)
    assert [n.returncode for n in nodes] != [0, 0], outputs
    for output in outputs:
        assert "give every node the same --nproc" in output, output


def test_a_node_joining_an_elastic_job_is_taken_after_a_save(tmp_path: Path) -> None:
    # Slow while alone (waiting for the second node), quick once both run; together, the
    # ranks end 3 steps past the first one they make (a count they agree on, as both resumed
    # from the same save): the checks are on the join, not on a long run after it.
    together = (
        "        if os.environ['WORLD_SIZE'] == '2':\n"
        "            steps = min(steps, rt.global_step + 3)\n"
    )
    elastic = PROGRAM.replace(
        "time.sleep(0.05)", "time.sleep(0.2 if os.environ['WORLD_SIZE'] == '1' else 0.01)"
    ).replace("        rt.step(opt)\n", "        rt.step(opt)\n" + together)
    assert together in elastic
    (tmp_path / "train.py").write_text(elastic)
    port = free_port()
    # Each meeting waits 5 s for more nodes once node 0 is there (torch's default: 30): on a
    # loaded machine node 1's agent can take more than 2 s to come back to the meeting node 0
    # reopens for it, and node 0 would then go on alone once more before taking it.
    first = _node(0, "1:2", port, tmp_path, ["train.py", "1000"], GPUKIT_RENDEZVOUS_LAST_CALL="5")
    deadline = time.monotonic() + 300
    while not (tmp_path / "ck" / f"step-{2 * PERIODIC:08d}").exists():
        if first.poll() is not None or time.monotonic() > deadline:
            first.kill()
            pytest.fail(f"node 0 did not train alone:\n{first.communicate()[0]}")
        time.sleep(0.1)
    second = _node(1, "1:2", port, tmp_path, ["train.py", "1000"], GPUKIT_RENDEZVOUS_LAST_CALL="5")
    outputs = _ends([first, second], timeout=600)
    assert [first.returncode, second.returncode] == [0, 0], outputs
    assert "nodes are waiting to join: the ranks saved, the job goes on with them" in outputs[0]
    assert "the world changed from 1 to 2 ranks: data sharding follows" in outputs[0]
    resumed = re.findall(r"resumed from ck at step (\d+)", outputs[0])
    assert len(resumed) == 1 and int(resumed[0]) > 2 * PERIODIC, outputs


# The one-node hang script with the stall on global rank 3 (node 1's second rank): the others
# wait for it in an all-reduce.
HANG_ON_NODE_1 = HANG.replace("dist.get_rank() == 1 and", "dist.get_rank() == 3 and")


def test_a_rank_hanging_on_node_1_is_named_on_every_node(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(HANG_ON_NODE_1)
    port = free_port()
    # 5 s: far more than a healthy step of this loop (two beats and a one-number all-reduce).
    args = ["--hang-timeout", "5", "hang.py"]
    nodes = [_node(r, 2, port, tmp_path, args, nproc=2) for r in range(2)]
    outputs = _ends(nodes)
    headline = re.compile(
        r"gpukit launch: rank 3 \(node 1\) hung: no heartbeat for \d+ s at step 3 \(phase "
        r"loop\), at hang\.py:9 in stall"
    )
    reports = []
    for node, out in zip(nodes, outputs, strict=True):
        assert node.returncode == 1, out
        assert headline.search(out), out
        for rank, where in ((0, 0), (1, 0), (2, 1)):
            assert re.search(
                rf"  rank {rank} \(node {where}\): waits in all_reduce \(torch/distributed/\S+\), "
                r"called from hang\.py:21 in main",
                out,
            ), out
        reports.append(re.search(r"hang-report\.txt are kept in (\S+)", out))
    kept = [Path(found[1]) for found in reports if found is not None]
    assert len(kept) == 2, outputs
    for folder in kept:
        assert folder.is_dir(), (folder, outputs)
        assert (folder / "hang-report.txt").is_file(), (sorted(folder.iterdir()), outputs)
    assert {p.name for p in kept[1].glob("stack-*")} == {"stack-2-0.txt", "stack-3-0.txt"}, outputs
    assert 'hang.py", line 9 in stall' in (kept[1] / "stack-3-0.txt").read_text()
    assert {p.name for p in kept[0].glob("stack-*")} == {"stack-0-0.txt", "stack-1-0.txt"}, outputs
    for folder in kept:
        assert "rank 3 (node 1) hung" in (folder / "hang-report.txt").read_text()
