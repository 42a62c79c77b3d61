"""Slurm and Kubernetes: gpukit launch reads the job's nodes from the variables they set,
fills in the node flags left out, refuses flags that contradict them and launches of the
wrong shape."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpukit.cli.__main__ import build_parser
from gpukit.cli.launch import run
from gpukit.errors import ConfigError
from gpukit.launch.clusters import FIELDS, detect, slurm_port, with_cluster_defaults
from gpukit.launch.hostlists import expand_hostlist, first_host


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
        ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("gpu[007]", ["gpu007"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x1,y[3,1],z", ["x1", "y3", "y1", "z"]),
        ("host-1.cluster,host-2.cluster", ["host-1.cluster", "host-2.cluster"]),
        ("c[100-101]-gpu[0-1]", ["c100-gpu0", "c100-gpu1", "c101-gpu0", "c101-gpu1"]),
    ],
)
def test_slurm_host_lists_expand_in_order_with_their_padding(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


def test_the_first_host_of_a_huge_list_is_read_without_expanding_it() -> None:
    assert first_host("gpu[0001-9999999],cpu[1-9999999]") == "gpu0001"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("node[01-04", "brackets do not pair up"),
        ("node01]", "brackets do not pair up"),
        ("node[[1-2]]", "brackets do not pair up"),
        ("node[a-b]", "holds 'a-b', not a number or a range"),
        ("node[4-2]", "holds '4-2', not a number or a range"),
        ("node[]", "holds '', not a number or a range"),
        ("node[１-2]", "not a number or a range"),
        ("a,,b", "an empty host name"),
    ],
)
def test_unreadable_host_lists_are_refused_naming_the_variable(text: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        expand_hostlist(text, "SLURM_JOB_NODELIST")
    message = str(refused.value)
    assert message.startswith(f"SLURM_JOB_NODELIST={text!r} is not a Slurm host list")
    assert why in message and "--master-addr" in message


def slurm(**extra: str) -> dict[str, str]:
    """A step of `srun --ntasks-per-node=1` in a 2-node allocation, on its second node."""
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "1",
        "SLURM_JOB_NODELIST": "node[01-02]",
    }
    return {**env, **extra}


def args(**given: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**dict.fromkeys(FIELDS), "script": "train.py", **given})


def test_outside_a_cluster_nothing_is_found_and_the_one_machine_defaults_stay(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert detect({}) is None
    assert detect({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) is None  # a pod, no training job
    filled = with_cluster_defaults(args(), env={})
    assert [getattr(filled, f) for f in FIELDS] == [1, 0, "127.0.0.1", None, 1]
    assert capsys.readouterr().err == ""


def test_a_slurm_step_on_two_nodes_gives_every_node_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    filled = with_cluster_defaults(args(), env=slurm(SLURM_GPUS_ON_NODE="8"))
    assert (filled.nnodes, filled.node_rank, filled.nproc) == (2, 1, 8)
    assert (filled.master_addr, filled.master_port) == ("node01", 21234)
    assert capsys.readouterr().err == (
        "gpukit launch: Slurm job 1234: node 1 of 2, 8 processes each, master node01:21234 "
        "(SLURM_NNODES, SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_JOB_ID, SLURM_GPUS_ON_NODE)\n"
    )


def test_the_slurm_port_is_the_same_on_every_node_and_unprivileged() -> None:
    ports = {detect(slurm(SLURM_NODEID=str(n))).master_port for n in range(2)}  # type: ignore[union-attr]
    assert ports == {slurm_port("1234")} == {21234}
    for job in ("1", "4294967295", "99999", "12345_7", "abc"):
        assert 20000 <= slurm_port(job) < 30000
    assert slurm_port("1234") != slurm_port("1235")
    assert detect(slurm(MASTER_PORT="29400")).master_port == 29400  # type: ignore[union-attr]


def test_the_step_node_list_and_count_come_before_the_allocations() -> None:
    found = detect(
        slurm(
            SLURM_JOB_NUM_NODES="4",
            SLURM_JOB_NODELIST="node[01-04]",
            SLURM_STEP_NUM_NODES="2",
            SLURM_STEP_NODELIST="node[03-04]",
        )
    )
    assert found is not None
    assert (found.nnodes, found.master_addr) == (2, "node03")
    assert found.sources["nnodes"] == "SLURM_STEP_NUM_NODES"
    found = detect(slurm(SLURM_NNODES="", SLURM_JOB_NODELIST="", SLURM_NODELIST="gpu[5-6]"))
    assert found is not None
    assert (found.nnodes, found.master_addr) == (2, "gpu5")
    assert found.sources["nnodes"] == "SLURM_JOB_NUM_NODES"


def test_a_one_node_slurm_job_meets_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "8"}
    filled = with_cluster_defaults(args(), env={**env, "SLURM_JOB_NODELIST": "gpu3"})
    assert [getattr(filled, f) for f in FIELDS] == [1, 0, "127.0.0.1", None, 1]
    assert capsys.readouterr().err == (
        "gpukit launch: Slurm job 77: one node, 1 process on this machine "
        "(SLURM_NNODES, SLURM_NODEID)\n"
    )


@pytest.mark.parametrize(
    ("extra", "nproc", "source"),
    [
        ({"SLURM_GPUS_ON_NODE": "4", "SLURM_GPUS_PER_NODE": "8"}, 4, "SLURM_GPUS_ON_NODE"),
        ({"SLURM_GPUS_PER_NODE": "8"}, 8, "SLURM_GPUS_PER_NODE"),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4, "SLURM_GPUS_PER_NODE"),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3, "SLURM_GPUS_PER_NODE"),
        ({}, 1, None),
    ],
)
def test_processes_per_node_default_to_slurms_gpus(
    extra: dict[str, str], nproc: int, source: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert with_cluster_defaults(args(), env=slurm(**extra)).nproc == nproc
    line = capsys.readouterr().err
    assert (source in line) if source else "GPUS" not in line
    assert with_cluster_defaults(args(nproc=2), env=slurm(**extra)).nproc == 2  # the flag wins
    assert "--nproc)" in capsys.readouterr().err


def test_an_unreadable_gpu_count_is_refused_unless_nproc_is_given() -> None:
    env = slurm(SLURM_GPUS_PER_NODE="a100:x")
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(), env=env)
    assert str(refused.value) == (
        "SLURM_GPUS_PER_NODE='a100:x' is not a GPU count gpukit can read: give --nproc"
    )
    assert with_cluster_defaults(args(nproc=4), env=env).nproc == 4
    assert with_cluster_defaults(args(), env=slurm(SLURM_GPUS_ON_NODE="0")).nproc == 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"SLURM_NTASKS": "16"},
            "SLURM_NTASKS=16 on SLURM_NNODES=2: Slurm started 16 copies of `gpukit launch`",
        ),
        (
            {"SLURM_STEP_NUM_TASKS": "4"},
            "SLURM_STEP_NUM_TASKS=4 on SLURM_NNODES=2: Slurm started 4 copies",
        ),
        (
            {"SLURM_NTASKS": "", "SLURM_NTASKS_PER_NODE": "8"},
            "SLURM_NTASKS_PER_NODE=8: Slurm starts 8 copies of `gpukit launch` on each node",
        ),
    ],
)
def test_several_launchers_per_node_are_refused(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        detect(slurm(**extra))
    text = str(refused.value)
    assert text.startswith(message)
    assert "srun --ntasks-per-node=1 gpukit launch --nproc N" in text


def test_the_steps_own_task_count_outranks_a_lingering_tasks_per_node() -> None:
    found = detect(slurm(SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS_PER_NODE="8"))
    assert found is not None and found.nnodes == 2


def test_a_batch_script_without_srun_on_several_nodes_is_refused() -> None:
    batch = {k: v for k, v in slurm().items() if k != "SLURM_STEP_ID"}
    batch.update(SLURM_NODEID="0", SLURM_PROCID="0")  # the batch script's own values
    with pytest.raises(ConfigError) as refused:
        detect(batch)
    text = str(refused.value)
    assert text.startswith("SLURM_NNODES=2 but no SLURM_STEP_ID: `gpukit launch` runs in the")
    assert "Start it with srun, one per node: `srun --ntasks-per-node=1 gpukit launch" in text
    one = {**batch, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "8"}
    assert detect(one) is not None  # one node: the batch script may launch itself


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"SLURM_NODEID": ""}, "SLURM_NNODES=2 but SLURM_NODEID is unset"),
        ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is outside 0..1 for SLURM_NNODES=2"),
        ({"SLURM_NNODES": "two"}, "SLURM_NNODES='two' is not a whole number in 1 or more"),
        ({"SLURM_NODEID": "٣"}, "SLURM_NODEID='٣' is not a whole number"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000' is not a whole number in 1..65535"),
    ],
)
def test_unreadable_slurm_values_are_refused(extra: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        detect(slurm(**extra))
    assert str(refused.value).startswith(message)


def kubernetes(**extra: str) -> dict[str, str]:
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", **extra}


def test_a_pytorchjob_pod_is_a_node_and_world_size_counts_pods(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A PyTorchJob with a Master and 2 Workers: worker 1 is pod rank 2 of 3.
    env = kubernetes(MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="3", RANK="2")
    filled = with_cluster_defaults(args(nproc=8), env=env)
    assert [getattr(filled, f) for f in FIELDS] == [3, 2, "job-master-0", 23456, 8]
    assert capsys.readouterr().err == (
        "gpukit launch: Kubernetes: node 2 of 3, 8 processes each, master job-master-0:23456 "
        "(WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT, --nproc)\n"
    )


def test_torchruns_variables_come_first_and_rank_is_ignored_when_it_counts_processes() -> None:
    # Kubeflow Trainer: PET_* for every flag; WORLD_SIZE and RANK, if any, count processes.
    env = kubernetes(
        PET_NNODES="2",
        PET_NODE_RANK="1",
        PET_MASTER_ADDR="job-node-0-0.job",
        PET_MASTER_PORT="29400",
        PET_NPROC_PER_NODE="4",
        WORLD_SIZE="8",
        RANK="5",
        JOB_COMPLETION_INDEX="1",
    )
    found = detect(env)
    assert found is not None
    assert (found.nnodes, found.node_rank, found.nproc) == (2, 1, 4)
    assert (found.master_addr, found.master_port) == ("job-node-0-0.job", 29400)
    assert dict(found.sources) == {
        "nnodes": "PET_NNODES",
        "node_rank": "PET_NODE_RANK",
        "master_addr": "PET_MASTER_ADDR",
        "master_port": "PET_MASTER_PORT",
        "nproc": "PET_NPROC_PER_NODE",
    }
    no_node_rank = detect({**env, "PET_NODE_RANK": ""})
    assert no_node_rank is not None and no_node_rank.node_rank == 1  # JOB_COMPLETION_INDEX
    assert no_node_rank.sources["node_rank"] == "JOB_COMPLETION_INDEX"


def test_an_elastic_pytorchjob_meets_at_its_rendezvous_endpoint() -> None:
    env = kubernetes(
        PET_NNODES="2:2", PET_RDZV_ENDPOINT="job-worker-0:23456", PET_RDZV_BACKEND="c10d"
    )
    found = detect(env)
    assert found is not None
    assert (found.nnodes, found.master_addr, found.master_port) == (2, "job-worker-0", 23456)
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(), env=env)
    assert str(refused.value).startswith(
        "PET_NNODES says this job has 2 nodes but Kubernetes does not say which node this is"
    )
    assert with_cluster_defaults(args(node_rank=1), env=env).node_rank == 1
    with pytest.raises(ConfigError, match="PET_NNODES='1:4' asks for between 1 and 4 nodes"):
        detect(kubernetes(PET_NNODES="1:4", PET_RDZV_ENDPOINT="job-worker-0:23456"))


def test_an_indexed_job_gives_the_rank_and_the_flags_the_rest() -> None:
    env = kubernetes(JOB_COMPLETION_INDEX="1")
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(), env=env)
    assert str(refused.value) == (
        "JOB_COMPLETION_INDEX=1 says this is node 1 of a job whose node count Kubernetes does "
        "not give: give --nnodes and --master-addr"
    )
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(nnodes=2), env=env)
    assert str(refused.value).startswith(
        "--nnodes says this job has 2 nodes but Kubernetes does not say where node 0 is "
        "(read JOB_COMPLETION_INDEX): give --master-addr"
    )
    one = with_cluster_defaults(args(), env=kubernetes(JOB_COMPLETION_INDEX="0"))
    assert (one.nnodes, one.node_rank, one.master_addr) == (1, 0, "127.0.0.1")
    filled = with_cluster_defaults(args(nnodes=2, master_addr="job-0.svc"), env=env)
    assert (filled.nnodes, filled.node_rank, filled.master_addr) == (2, 1, "job-0.svc")


@pytest.mark.parametrize(
    ("given", "env", "message"),
    [
        (
            {"nnodes": 4},
            slurm(),
            "--nnodes 4 contradicts SLURM_NNODES=2: Slurm gives this job 2 nodes. Leave --nnodes "
            "out (gpukit reads SLURM_NNODES), or ask Slurm for 4 nodes",
        ),
        (
            {"node_rank": 0},
            slurm(),
            "--node-rank 0 contradicts SLURM_NODEID=1: Slurm says this is node 1. Leave "
            "--node-rank out (gpukit reads SLURM_NODEID)",
        ),
        (
            {"nnodes": 1},
            kubernetes(WORLD_SIZE="3", RANK="0", MASTER_ADDR="m", MASTER_PORT="1"),
            "--nnodes 1 contradicts WORLD_SIZE=3: Kubernetes gives this job 3 nodes",
        ),
    ],
)
def test_a_flag_that_contradicts_the_cluster_is_refused_naming_both(
    given: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(**given), env=env)
    assert str(refused.value).startswith(message)


def test_flags_that_agree_or_override_the_address_and_port_win(
    capsys: pytest.CaptureFixture[str],
) -> None:
    given = args(nnodes=2, node_rank=1, master_addr="10.1.0.1", master_port=29500)
    filled = with_cluster_defaults(given, env=slurm())
    assert [getattr(filled, f) for f in FIELDS] == [2, 1, "10.1.0.1", 29500, 1]
    assert capsys.readouterr().err.endswith(
        "master 10.1.0.1:29500 (--nnodes, --node-rank, --master-addr, --master-port)\n"
    )


def test_launch_reads_this_processs_environment_and_refuses_before_starting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in slurm(SLURM_NTASKS="16").items():
        monkeypatch.setenv(name, value)
    script = tmp_path / "train.py"
    script.write_text("")
    parsed = build_parser().parse_args(["launch", str(script)])
    assert [getattr(parsed, f) for f in FIELDS] == [None] * 5  # "not given"
    with pytest.raises(ConfigError, match="SLURM_NTASKS=16 on SLURM_NNODES=2"):
        run(parsed)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(ConfigError, match="--nnodes 3 contradicts SLURM_NNODES=2"):
        run(build_parser().parse_args(["launch", "--nnodes", "3", str(script)]))


SCRIPT = """
import os, sys, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    f.write(os.environ["WORLD_SIZE"])
dist.destroy_process_group()
"""


@pytest.mark.processes
def test_srun_gpukit_launch_in_a_one_node_allocation_runs_the_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    step = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "1",
        "SLURM_NODEID": "0",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NODELIST": "gpu07",
        "SLURM_GPUS_ON_NODE": "2",  # no --nproc: two processes, one per GPU
    }
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "launch", str(script), str(tmp_path)],
        text=True,
        capture_output=True,
        timeout=120,
        check=False,
        env={**os.environ, **step},
    )
    assert done.returncode == 0, done.stderr
    assert (
        "gpukit launch: Slurm job 4242: one node, 2 processes on this machine "
        "(SLURM_NNODES, SLURM_NODEID, SLURM_GPUS_ON_NODE)"
    ) in done.stderr.splitlines()
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2", "2"]


def test_the_lines_docs_clusters_shows_are_the_ones_printed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "clusters.md").read_text()
    with_cluster_defaults(args(), env=slurm(SLURM_GPUS_ON_NODE="8"))
    assert capsys.readouterr().err in page
    with pytest.raises(ConfigError) as refused:
        with_cluster_defaults(args(nnodes=4), env=slurm())
    assert f"gpukit launch: error: {refused.value}\n" in page
