"""What the bench tests share, made once per session: the quick run of every experiment that
a test module reads on this machine's CPU (the strategies experiment trains every strategy,
launching processes; the calibration experiment trains every case twice over; matmul,
transfer, sync and multidevice each time several sizes or setups). `gpukit bench all --quick`
in test_suite.py is handed these same results rather than measuring them a second time, and
the tests that read them run on one pytest-xdist worker (``xdist_group("bench-quick")``, put
on each such test below), so that each is made once in the whole run."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from gpukit.bench import matmul, multidevice, precision, speed, strategies, sync, transfer
from gpukit.bench.result import BenchResult
from gpukit.cli.__main__ import main

BENCH_QUICK = pytest.mark.xdist_group("bench-quick")
CPU = torch.device("cpu")
# The session fixtures below, each the quick run of one experiment.
QUICK_RESULTS = (
    "quick_matmul",
    "quick_transfer",
    "quick_sync",
    "quick_multidevice",
    "quick_strategies",
    "quick_precision",
    "quick_calibration_printed",
    "quick_speed",
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that reads a shared quick result runs where that result is made."""
    for item in items:
        if set(QUICK_RESULTS) & set(getattr(item, "fixturenames", ())):
            item.add_marker(BENCH_QUICK)


@pytest.fixture(scope="session")
def quick_matmul() -> BenchResult:
    """`gpukit bench matmul --quick` on this machine's CPU."""
    return matmul.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_transfer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache folder of the quick transfer run alone: what it kept for the trace."""
    return tmp_path_factory.mktemp("transfer") / "cache"


@pytest.fixture(scope="session")
def quick_transfer(quick_transfer_cache: Path) -> BenchResult:
    """`gpukit bench transfer --quick` on this machine's CPU, keeping what it keeps for the
    trace (as the command does) in a cache folder of its own, where test_transfer.py reads
    that a CPU-only run keeps nothing."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GPUKIT_CACHE_DIR", str(quick_transfer_cache))
        return transfer.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_sync() -> BenchResult:
    """`gpukit bench sync --quick` on this machine's CPU."""
    return sync.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_multidevice() -> BenchResult:
    """`gpukit bench multidevice --quick` on this machine's CPU."""
    return multidevice.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_strategies() -> BenchResult:
    """`gpukit bench strategies --quick` on this machine's CPU."""
    return strategies.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_precision() -> BenchResult:
    """`gpukit bench precision --quick` on this machine's CPU."""
    return precision.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_speed() -> BenchResult:
    """`gpukit bench speed --quick` on this machine's CPU."""
    return speed.run(quick=True, devices=[CPU])


@pytest.fixture(scope="session")
def quick_calibration_printed() -> tuple[int, str]:
    """What `gpukit bench calibration --quick --steps 5 --json` exits with and prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "calibration", "--quick", "--steps", "5", "--json"])
    return code, printed.getvalue()


@pytest.fixture(scope="session")
def quick_calibration(quick_calibration_printed: tuple[int, str]) -> BenchResult:
    """The result that command printed."""
    printed = quick_calibration_printed[1]
    return BenchResult.from_dict(json.loads(printed[printed.index("{\n") :]))
