"""What the bench tests share, made once per session: the quick runs of the experiments that
cost the most (the strategies experiment trains every strategy, launching processes; the
calibration experiment trains every case twice over). `gpukit bench all --quick` in
test_suite.py is handed these same results rather than measuring them a second time, and the
modules that read them run on one pytest-xdist worker (``xdist_group("bench-quick")``), so
that each is made once in the whole run."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from gpukit.bench import precision, strategies
from gpukit.bench.result import BenchResult
from gpukit.cli.__main__ import main

BENCH_QUICK = pytest.mark.xdist_group("bench-quick")


@pytest.fixture(scope="session")
def quick_strategies() -> BenchResult:
    """`gpukit bench strategies --quick` on this machine's CPU."""
    return strategies.run(quick=True, devices=[torch.device("cpu")])


@pytest.fixture(scope="session")
def quick_precision() -> BenchResult:
    """`gpukit bench precision --quick` on this machine's CPU."""
    return precision.run(quick=True, devices=[torch.device("cpu")])


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
