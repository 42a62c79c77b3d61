"""A rank's figures from reads of its beat: windows of whole steps, own time, shares, memory."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpukit.launch.heartbeat import PHASES, Beat
from gpukit.launch.rank_stats import WINDOWS, RankStats, add_shares, memory, rss


def beat(step: int, time: float, spent: dict[str, float], attempt: int = 0) -> Beat:
    return Beat(
        rank=0,
        time=time,
        step=step,
        saved_step=-1,
        pid=1,
        phase="loop",
        stop_requested=False,
        attempt=attempt,
        spent=tuple(spent.get(p, 0.0) for p in PHASES),
        samples_per_step=8,
    )


def test_a_window_is_the_steps_between_two_reads_and_its_own_time_leaves_out_meetings() -> None:
    stats = RankStats(0)
    stats.observe(beat(10, 100.0, {"data": 1.0, "backward": 2.0}))
    assert stats.window is None  # one read: nothing to compare yet
    stats.observe(beat(10, 100.5, {"data": 1.2, "backward": 2.3}))
    assert stats.window is None  # the step did not move: the window stays open
    # 4 steps in 2 s: 0.4 s in data, 1.0 s in backward, 0.2 s in collectives, 0.4 s forward.
    spent = {"data": 1.4, "backward": 3.0, "collective": 0.2, "forward": 0.4}
    stats.observe(beat(14, 102.0, spent))
    window = stats.window
    assert window is not None and window.steps == 4
    assert window.step_s == pytest.approx(0.5)
    assert window.own_s == pytest.approx((2.0 - 1.0 - 0.2) / 4)
    assert window.phases_s["data"] == pytest.approx(0.1)
    assert window.phases_s["forward"] == pytest.approx(0.1)
    assert stats.step_s_median == pytest.approx(0.5)
    assert stats.samples_per_s() == pytest.approx(16.0)


def test_the_seconds_a_rank_took_to_start_are_in_no_window() -> None:
    stats = RankStats(0)
    stats.observe(replace(beat(0, 100.0, {}), phase="start"))  # read while it starts
    # 30 s later it is in its first step: those 30 s went to starting, not to a step.
    stats.observe(replace(beat(0, 130.0, {"start": 20.0, "setup": 10.0}), phase="forward"))
    assert stats.window is None
    stats.observe(beat(10, 131.0, {"start": 20.0, "setup": 10.0, "forward": 0.6}))
    window = stats.window
    assert window is not None and window.steps == 10
    assert window.step_s == pytest.approx(0.1) and window.own_s == pytest.approx(0.1)
    assert stats.step_s_median == pytest.approx(0.1)


def test_the_median_step_is_over_the_last_windows_only() -> None:
    stats = RankStats(0)
    time, step = 0.0, 0
    stats.observe(beat(step, time, {}))
    for length in [10.0] * 5 + [1.0] * WINDOWS:  # slow windows, then as many fast ones
        step, time = step + 1, time + length
        stats.observe(beat(step, time, {"loop": time}))
    assert stats.step_s_median == pytest.approx(1.0)


def test_a_new_attempt_starts_the_figures_over() -> None:
    stats = RankStats(0)
    stats.observe(beat(10, 0.0, {}))
    stats.observe(beat(12, 1.0, {"loop": 1.0}))
    assert stats.window is not None
    stats.observe(replace(beat(8, 5.0, {}), attempt=1))  # resumed from a checkpoint at 8
    assert stats.window is None and stats.step_s_median is None


def test_shares_split_a_step_into_data_waiting_and_compute() -> None:
    ranks = [
        {"own_s": 0.02, "window_s": 0.1, "phases_s": {"data": 0.01}},
        {"own_s": 0.08, "window_s": 0.1, "phases_s": {"data": 0.06}},  # the one waited for
        {"own_s": None, "window_s": None, "phases_s": None},  # no window yet
    ]
    add_shares(ranks)
    assert ranks[0]["shares"] == {"data": 0.1, "coll": 0.6, "compute": 0.3}
    assert ranks[1]["shares"] == {"data": 0.6, "coll": 0.0, "compute": 0.4}
    assert ranks[2]["shares"] is None


def test_memory_says_unknown_device_bytes_as_none_and_reads_the_rss() -> None:
    said = memory(replace(beat(1, 0.0, {}), memory=(10, 20, -1)), os.getpid())
    assert said["allocated"] == 10 and said["peak"] == 20 and said["reserved"] is None
    assert said["rss"] is not None and said["rss"] > 1 << 20
    assert memory(None, None) == {"allocated": None, "peak": None, "reserved": None, "rss": None}


def test_the_rss_of_a_process_that_is_gone_is_unknown(tmp_path: Path) -> None:
    assert rss(2**22 + 12345) is None
