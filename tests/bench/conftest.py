"""What the bench tests share: the strategies experiment's quick run, the slowest of the quick
runs (it trains every strategy, launching processes), made once per session."""

from __future__ import annotations

import pytest
import torch

from gpukit.bench import strategies
from gpukit.bench.result import BenchResult


@pytest.fixture(scope="session")
def quick_strategies() -> BenchResult:
    """`gpukit bench strategies --quick` on this machine's CPU."""
    return strategies.run(quick=True, devices=[torch.device("cpu")])
