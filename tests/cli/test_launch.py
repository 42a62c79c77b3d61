"""gpukit launch: torchrun-style scripts unchanged, several nodes on 127.0.0.1, failures."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpukit.cli.launch import check, describe_exit, nodes
from gpukit.errors import ConfigError
from gpukit.launch.ports import free_port

SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
if os.environ.get("FAIL_RANK") == str(dist.get_rank()):
    raise RuntimeError("rank " + os.environ["RANK"] + " gives up")
dist.barrier()
out = os.path.join(sys.argv[1], "rank" + os.environ["RANK"])
with open(out, "w") as f:
    f.write(f"{dist.get_world_size()} {os.environ['LOCAL_RANK']} {total.item()}")
dist.destroy_process_group()
"""


def gpukit(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:

    return subprocess.Popen(
        [sys.executable, "-m", "gpukit", "launch", *args],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


# Cold: `gpukit launch`'s default start of its ranks, kept under a real multi-process test.
@pytest.mark.cold_start
@pytest.mark.processes
def test_plain_torchrun_script_runs_on_two_processes(script: Path, tmp_path: Path) -> None:
    done = gpukit("--nproc", "2", str(script), str(tmp_path))
    output, _ = done.communicate(timeout=120)
    assert done.returncode == 0, output
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2 0 1.0", "2 1 1.0"]


# Accelerate's `Accelerator(cpu=True)` and Fabric's `Fabric(accelerator="cpu")`, ported.
CPU_SCRIPT = """
import sys, torch, torch.distributed as dist, gpukit as gk
from torch.utils.data import DataLoader, TensorDataset
rt = gk.Runtime(devices="cpu", seed=0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
model, optimizer, loader = rt.setup(model, optimizer, data)
for x, y in loader:
    rt.backward(torch.nn.functional.mse_loss(model(x), y))
    rt.step(optimizer)
batches = int(rt.all_gather(len(loader)).sum())
weights = rt.all_gather(rt.unwrap(model).weight.detach())
same = bool((weights[0] == weights[1]).all())
with open(sys.argv[1] + "/rank" + str(rt.rank), "w") as f:
    f.write(f"{rt.world_size} {rt.device} {dist.get_backend()} {batches} {rt.global_step} {same}")
rt.teardown()
"""


@pytest.mark.processes
@pytest.mark.parametrize("launcher", ["gpukit", "torchrun"])
def test_devices_cpu_puts_every_launched_rank_on_the_cpu(tmp_path: Path, launcher: str) -> None:
    """``devices="cpu"`` under a launcher of 2 processes: 2 gloo ranks on the CPU, each with
    half the batches, the same weights after the steps (on a machine with GPUs too)."""
    script = tmp_path / "train.py"
    script.write_text(CPU_SCRIPT)
    if launcher == "gpukit":
        done = gpukit("--nproc", "2", str(script), str(tmp_path))
    else:  # a port of its own: torchrun's default (29500) is shared by every test run here
        port = ["--master-port", str(free_port())]
        args = ["-m", "torch.distributed.run", "--nproc-per-node", "2", *port, str(script)]
        done = subprocess.Popen(
            [sys.executable, *args, str(tmp_path)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    output, _ = done.communicate(timeout=180)
    assert done.returncode == 0, output
    results = [p.read_text() for p in sorted(tmp_path.glob("rank*"))]
    assert results == ["2 cpu gloo 4 2 True"] * 2, output


@pytest.mark.processes
def test_two_nodes_on_one_machine_form_one_four_process_job(script: Path, tmp_path: Path) -> None:
    port = str(free_port())
    common = ["--nproc", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    nodes = [gpukit(*common, "--node-rank", str(r), str(script), str(tmp_path)) for r in (0, 1)]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    results = {p.name: p.read_text() for p in tmp_path.glob("rank*")}
    assert sorted(results) == ["rank0", "rank1", "rank2", "rank3"]
    assert all(v.startswith("4 ") and v.endswith(" 6.0") for v in results.values())


@pytest.mark.processes
def test_a_failing_rank_ends_the_job_nonzero_with_its_error(script: Path, tmp_path: Path) -> None:
    done = gpukit("--nproc", "2", str(script), str(tmp_path), env={"FAIL_RANK": "1"})
    try:
        output, _ = done.communicate(timeout=300)  # a hang guard only
    except subprocess.TimeoutExpired:
        done.kill()
        pytest.fail(f"gpukit launch did not end after a rank failed:\n{done.communicate()[0]}")
    assert done.returncode == 1
    # Rank 0 was waiting in the barrier for rank 1: it never got past it to write its result.
    assert not list(tmp_path.glob("rank*"))
    assert "RuntimeError: rank 1 gives up" in output
    # Rank 0 then fails on the broken connection, or is stopped: rank 1 is the one named.
    assert re.search(
        r"gpukit launch: rank 1 raised RuntimeError: rank 1 gives up — the first failure; "
        r"rank 0 (failed after it|stopped)\n",
        output,
    ), output
    # Every rank gets a line, the one that failed first on top with its error.
    summary = output[output.index("gpukit launch: rank 1 raised") :].splitlines()
    assert summary[1] == "  rank 1: raised RuntimeError: rank 1 gives up" or summary[1].startswith(
        "  rank 1: raised RuntimeError: rank 1 gives up (exit code -6 (SIGABRT))"
    )
    assert summary[2].startswith("  rank 0: ")
    assert "runpy" not in output


@pytest.mark.parametrize(
    ("code", "words"),
    [(1, "1"), (0, "0"), (-6, "-6 (SIGABRT)"), (-9, "-9 (SIGKILL)"), (-99, "-99 (signal 99)")],
)
def test_exit_codes_name_their_signal(code: int, words: str) -> None:
    assert describe_exit(code) == words


@pytest.mark.processes
def test_port_in_use_is_refused_before_starting(script: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = gpukit("--master-port", str(port), str(script), "x")
        output, _ = done.communicate(timeout=60)
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in output and "Traceback" not in output


@pytest.mark.processes
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "script 'missing.py' not found"),
        (["--nproc", "0", "SCRIPT"], "--nproc 0: give at least 1"),
        (["--nnodes", "2", "--node-rank", "2", "SCRIPT"], "--node-rank 2 is outside 0..1"),
        (["--master-port", "70000", "SCRIPT"], "--master-port 70000: give a TCP port in 1..65535"),
    ],
)
def test_bad_requests_are_one_line_errors(script: Path, args: list[str], message: str) -> None:
    args = [str(script) if a == "SCRIPT" else a for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "launch", *args],
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def namespace(**given: Any) -> argparse.Namespace:
    args = {
        "nproc": 2,
        "nnodes": "2",
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "max_restarts": 0,
        "hang_timeout": None,
        "startup_timeout": None,
        "straggler_factor": "1.2",
        "straggler_steps": "20",
        "script": __file__,
        "script_args": ["--x"],
    }
    return argparse.Namespace(**{**args, **given})


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"master_port": 0}, "--master-port 0: give a TCP port in 1..65535"),
        ({"master_port": -1}, "--master-port -1: give a TCP port in 1..65535"),
        ({"master_port": 65536}, "--master-port 65536: give a TCP port in 1..65535"),
        (
            {"master_addr": "no-such-host.invalid"},
            "--master-addr 'no-such-host.invalid' does not resolve",
        ),
        ({"hang_timeout": -5.0}, "--hang-timeout -5: give seconds, 0 or more"),
        ({"hang_timeout": float("nan")}, "--hang-timeout nan: give seconds, 0 or more"),
        ({"max_restarts": -1}, "--max-restarts -1: give 0 or more"),
        ({"startup_timeout": -1.0}, "--startup-timeout -1: give seconds, 0 or more"),
        ({"startup_timeout": float("inf")}, "--startup-timeout inf: give seconds, 0 or more"),
        ({"straggler_factor": "1"}, "--straggler-factor 1: give a number over 1"),
        ({"straggler_factor": "0.5"}, "--straggler-factor 0.5: give a number over 1"),
        ({"straggler_factor": "fast"}, "--straggler-factor fast: give a number over 1"),
        ({"straggler_factor": "inf"}, "--straggler-factor inf: give a number over 1"),
        ({"straggler_steps": "-1"}, "--straggler-steps -1: give a whole number of steps"),
        ({"straggler_steps": "2.5"}, "--straggler-steps 2.5: give a whole number of steps"),
        ({"straggler_steps": "many"}, "--straggler-steps many: give a whole number of steps"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check(namespace(**given))
    assert str(refused.value).startswith(message)


def test_0_0_0_0_for_several_machines_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    check(namespace(master_addr="0.0.0.0"))
    assert "--master-addr 0.0.0.0 listens on every interface" in capsys.readouterr().err
    check(namespace(master_addr="0.0.0.0", nnodes=1))  # one machine binds 127.0.0.1 anyway
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("nnodes", "expected"), [("1", None), ("2", (2, 2)), ("1:3", (1, 3)), ("3:3", (3, 3))]
)
def test_nnodes_is_a_count_or_a_range(nnodes: str, expected: tuple[int, int] | None) -> None:
    args = namespace(nnodes=nnodes, master_port=None)
    check(args)
    found = nodes(args)
    if expected is None:
        assert found is None  # one machine: no rendezvous at all
    else:
        assert found is not None and (found.min_nodes, found.max_nodes) == expected
        assert (found.master_addr, found.master_port) == ("127.0.0.1", 29500)


@pytest.mark.parametrize("nnodes", ["0", "3:2", "a", "1:2:3", ""])
def test_a_bad_nnodes_is_refused(nnodes: str) -> None:
    with pytest.raises(ConfigError, match=r"give the number of machines \(1 or more\), or MIN:MAX"):
        check(namespace(nnodes=nnodes))
