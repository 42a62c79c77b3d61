"""Timing on a device: warm-up, rotation of inputs, repeats within a budget, and the summary."""

from __future__ import annotations

import pytest
import torch

from gpukit.bench.measure import bench_devices, measure, stats
from gpukit.errors import ConfigError

CPU = torch.device("cpu")


def test_warmup_then_repeats_rotate_through_the_inputs() -> None:
    seen: list[int] = []
    s = measure(seen.append, CPU, inputs=[0, 1, 2], repeats=7, warmup=2, budget_s=1e9)
    assert seen == [0, 1, *[0, 1, 2, 0, 1, 2, 0]]  # warm-up, then the timed calls
    assert s.n == 7 and len(s.raw) == 7
    assert s.low <= s.q1 <= s.median <= s.q3 <= s.high


def test_the_budget_stops_repeats_but_never_below_the_minimum() -> None:
    calls = []
    s = measure(calls.append, CPU, repeats=50, min_repeats=4, warmup=0, budget_s=0.0)
    assert s.n == 4 and len(calls) == 4


@pytest.mark.parametrize("bad", [{"repeats": 0}, {"min_repeats": -1}, {"repeats": True}])
def test_bad_counts_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="whole number of at least 1"):
        measure(lambda _: None, CPU, **bad)


def test_stats_of_one_value_and_of_none() -> None:
    one = stats([2.0])
    assert (one.median, one.q1, one.q3, one.spread()) == (2.0, 2.0, 2.0, 0.0)
    with pytest.raises(ValueError):
        stats([])


def test_the_cpu_is_always_a_bench_device() -> None:
    found = bench_devices()
    assert found[0] == CPU
    assert all(d.type == "cuda" for d in found[1:])
    assert bench_devices(cpu=False) == found[1:]


@pytest.mark.gpu
def test_cuda_events_time_the_work_not_the_launch() -> None:
    """A product queued on the GPU returns at once; the events must see its real duration,
    which grows with the size of the work."""
    dev = torch.device("cuda", 0)
    small = torch.randn(256, 256, device=dev)
    large = torch.randn(4096, 4096, device=dev)
    t_small = measure(lambda x: x @ x, dev, inputs=[small], repeats=5).median
    t_large = measure(lambda x: x @ x, dev, inputs=[large], repeats=5).median
    assert t_large > 20 * t_small
    host = measure(lambda x: x @ x, dev, inputs=[large], repeats=5, clock="host").median
    assert 0.5 < host / t_large < 3
