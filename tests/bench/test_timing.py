"""The shared timing helper: rotation, warm-up, the garbage collector, the synchronize hook,
threads and ratios. Only the bookkeeping is checked, never the size of a timing."""

from __future__ import annotations

import gc

import pytest
import torch

from gpukit.bench.timing import Timings, check_count, synchronizer, time_rounds, torch_threads
from gpukit.devices import clock as clock_module
from gpukit.errors import ConfigError


def test_rounds_rotate_the_order_after_the_warm_up() -> None:
    calls: list[str] = []
    runs = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    t = time_rounds(runs, rounds=4, warmup=2)
    assert calls == list("abc" * 2 + "abc" + "bca" + "cab" + "abc")
    assert {name: len(s) for name, s in t.seconds.items()} == {"a": 4, "b": 4, "c": 4}


def test_seconds_are_per_unit_of_work(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(range(0, 100, 5))  # every timed block lasts 5 "seconds"
    monkeypatch.setattr(clock_module.time, "perf_counter", lambda: float(next(clock)))
    t = time_rounds({"a": lambda: None, "b": lambda: None}, rounds=2, per=10, warmup=0)
    assert t.seconds == {"a": (0.5, 0.5), "b": (0.5, 0.5)}
    assert t.ratio("a", "b") == 1.0


def test_the_collector_is_off_while_timing_and_restored_after() -> None:
    seen: list[bool] = []
    assert gc.isenabled() and gc.get_freeze_count() == 0
    time_rounds({"a": lambda: seen.append(gc.isenabled())}, rounds=2, warmup=1)
    assert seen == [True, False, False]  # the warm-up runs as the user's code would
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_collector_is_restored_when_a_run_fails() -> None:
    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        time_rounds({"a": boom}, rounds=1, warmup=0)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_synchronize_comes_before_each_clock_read() -> None:
    events: list[str] = []
    time_rounds(
        {"a": lambda: events.append("run")},
        rounds=2,
        warmup=0,
        synchronize=lambda: events.append("sync"),
    )
    assert events == ["sync", "run", "sync"] * 2


def test_synchronizer_per_device() -> None:
    assert synchronizer("cpu") is None and synchronizer(torch.device("cpu")) is None
    assert synchronizer("cuda:0") is not None  # built without touching the GPU


def test_ratios_are_per_round_then_the_median() -> None:
    t = Timings({"x": (2.0, 9.0, 3.0), "base": (1.0, 3.0, 2.0)})
    assert t.ratios("x", "base") == (2.0, 3.0, 1.5)
    assert t.ratio("x", "base") == 2.0  # not median(x) / median(base) == 1.5
    assert t.ratio("base", "base") == 1.0 and t.median("x") == 3.0


def test_threads_are_restored_even_after_an_error() -> None:
    before = torch.get_num_threads()
    with pytest.raises(ValueError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise ValueError
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_counts_must_be_whole_numbers_of_at_least_one(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"=.*: give a whole number of at least 1 \(why\)"):
        check_count("n", bad, "why")
    with pytest.raises(ConfigError, match="rounds="):
        time_rounds({"a": lambda: None}, rounds=bad)  # type: ignore[arg-type]
