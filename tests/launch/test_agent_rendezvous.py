"""A launched rank whose peers never come fails within GPUKIT_RENDEZVOUS_TIMEOUT, saying
where it waited and why that usually happens (RANK/WORLD_SIZE left in the shell)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpukit.launch.ports import free_port

pytestmark = pytest.mark.processes

PROGRAM = """
import gpukit as gk
try:
    gk.Runtime(devices="cpu")
except gk.GpukitError as err:
    print(type(err).__name__ + ": " + str(err))
"""


def start_alone(rank: int, extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", **extra}
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    try:
        return subprocess.run(
            [sys.executable, "-c", PROGRAM],
            text=True,
            capture_output=True,
            timeout=60,  # a hang guard: the rendezvous gives up after 1 s
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the rendezvous did not end:\n{err.stdout}\n{err.stderr}")


def test_rank_0_alone_gives_up_within_the_bound_and_says_why() -> None:
    port = free_port()
    done = start_alone(
        0, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GPUKIT_RENDEZVOUS_TIMEOUT": "1"}
    )
    out = done.stdout
    assert out.startswith(
        f"LaunchError: rank 0 of 2 waited 1 s at 127.0.0.1:{port} for all 2 ranks to join"
    ), done.stdout + done.stderr
    assert "`unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT`" in out
    assert "a firewall" in out and "GPUKIT_RENDEZVOUS_TIMEOUT" in out


def test_rank_and_world_size_without_an_address_are_refused_at_once() -> None:
    done = start_alone(0, {"MASTER_ADDR": "", "MASTER_PORT": ""})
    assert done.stdout.startswith("ConfigError: rank 0 of 2 (RANK and WORLD_SIZE are set) needs")
    assert "`unset RANK WORLD_SIZE`" in done.stdout
