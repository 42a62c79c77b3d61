"""gpukit launch: torchrun-style scripts unchanged, several nodes on 127.0.0.1, failures."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpukit.cli.launch import RUNNER, check, describe_exit, failure_summary, torchrun_args
from gpukit.errors import ConfigError
from gpukit.launch.spawn import free_port

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
    import os

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


@pytest.mark.processes
def test_plain_torchrun_script_runs_on_two_processes(script: Path, tmp_path: Path) -> None:
    done = gpukit("--nproc", "2", str(script), str(tmp_path))
    output, _ = done.communicate(timeout=120)
    assert done.returncode == 0, output
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2 0 1.0", "2 1 1.0"]


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


def failure(exitcode: int, timestamp: int, time_ns: int | None = None, error: str = "") -> Any:
    """A stand-in for torchrun's ProcessFailure, as its error file left it."""
    extra = {} if time_ns is None else {"time_ns": str(time_ns), "timestamp": str(timestamp)}
    data = {"message": {"message": error, "extraInfo": extra}} if error else {"message": ""}
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, error_file_data=data)


def test_the_summary_names_the_first_recorded_error_even_within_one_second() -> None:
    failures = {
        0: failure(1, 100, 100_900_000_000, "RuntimeError: Connection closed by peer"),
        1: failure(-6, 100, 100_200_000_000, "RuntimeError: rank 1 gives up\nsecond line"),
        2: failure(-15, 100),  # stopped by torchrun after the others failed: nothing recorded
    }
    assert failure_summary(failures).splitlines() == [
        "gpukit launch: rank 1 failed with exit code -6 (SIGABRT) (3 rank(s) failed); "
        "its output is above",
        "  rank 1: exit code -6 (SIGABRT), RuntimeError: rank 1 gives up",
        "  rank 0: exit code 1, RuntimeError: Connection closed by peer",
        "  rank 2: exit code -15 (SIGTERM), no Python error recorded",
    ]


def test_an_error_that_only_says_a_peer_went_away_comes_after_the_peers_failure() -> None:
    failures = {
        0: failure(1, 100, 100_100_000_000, "RuntimeError: Connection reset by peer"),
        1: failure(-9, 101),  # killed: nothing recorded, torchrun's whole seconds only
    }
    assert (
        failure_summary(failures)
        .splitlines()[0]
        .startswith("gpukit launch: rank 1 failed with exit code -9 (SIGKILL)")
    )


def test_without_recorded_errors_torchruns_order_is_kept() -> None:
    failures = {3: failure(-9, 101), 2: failure(-15, 102)}
    lines = failure_summary(failures).splitlines()
    assert lines[0].startswith("gpukit launch: rank 3 failed with exit code -9 (SIGKILL) (2 rank")
    assert lines[1:] == [
        "  rank 3: exit code -9 (SIGKILL), no Python error recorded",
        "  rank 2: exit code -15 (SIGTERM), no Python error recorded",
    ]


def test_a_long_error_is_cut_to_one_short_line() -> None:
    line = failure_summary({0: failure(1, 5, 5, "E" * 500)}).splitlines()[1]
    assert len(line) < 200 and line.endswith("...")


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
        "nnodes": 2,
        "node_rank": 0,
        "master_addr": "127.0.0.1",
        "master_port": free_port(),
        "max_restarts": 0,
        "hang_timeout": None,
        "startup_timeout": None,
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


def test_several_machines_meet_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_RENDEZVOUS_TIMEOUT", "7.5")
    args = namespace()
    argv = torchrun_args(args)
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=8"
    assert argv[argv.index("--master-port") + 1] == str(args.master_port)
    assert argv[-3:] == [str(RUNNER), __file__, "--x"]


def test_restarts_on_several_machines_take_a_fresh_store_each_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")  # restored after the test
    monkeypatch.delenv("GPUKIT_RENDEZVOUS_TIMEOUT", raising=False)
    args = namespace(max_restarts=2, node_rank=1)
    argv = torchrun_args(args)
    assert os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-endpoint") + 1] == f"127.0.0.1:{args.master_port}"
    assert argv[argv.index("--rdzv-conf") + 1] == "join_timeout=120,is_host=false"
