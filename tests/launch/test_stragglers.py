"""The straggler rule on synthetic windows: named once after `steps` slow steps in a row, with
the phase of its largest excess, recovered once; and the settings' checks."""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.errors import ConfigError
from gpukit.launch import run_job
from gpukit.launch.job import straggler_settings
from gpukit.launch.stragglers import Seen, Stragglers, gpu_words

FAST = {"data": 0.002, "forward": 0.010, "optimizer": 0.003, "loop": 0.001}


def ranks(step: int, slow: dict[int, dict[str, float]], n: int = 4) -> list[Seen]:
    """``n`` ranks at ``step``; those in ``slow`` spend those seconds per step instead."""
    return [
        Seen(r, r // 2, f"h{r // 2}", step, sum(slow.get(r, FAST).values()), slow.get(r, FAST))
        for r in range(n)
    ]


def run(detector: Stragglers, steps: range, slow: dict[int, dict[str, float]]) -> list[Any]:
    events = []
    for step in steps:
        events += detector.judge(ranks(step, slow), attempt=0, now=float(step))
    return events


SLOW_DATA = {**FAST, "data": 0.030}


def test_a_slow_rank_is_named_once_after_steps_in_a_row_with_its_phase() -> None:
    detector = Stragglers(factor=1.2, steps=20)
    events = run(detector, range(0, 100, 5), {1: SLOW_DATA})
    assert [(e["kind"], e["rank"], e["phase"]) for e in events] == [("straggler", 1, "data")]
    named = events[0]
    assert named["step"] == 20 and named["node"] == 0 and named["host"] == "h0"
    assert named["slowdown"] == pytest.approx(sum(SLOW_DATA.values()) / sum(FAST.values()), 0.01)
    assert named["text"] == (
        "straggler: rank 1 (node 0, host h0) is 2.75x slower than the median rank for 20 steps "
        "(own time 44 ms vs 16 ms per step), mostly in data (+28 ms per step)"
    )
    assert detector.now_slow == [named]


def test_a_rank_slow_for_fewer_steps_than_asked_is_not_named() -> None:
    detector = Stragglers(factor=1.2, steps=20)
    events = run(detector, range(0, 15, 5), {2: SLOW_DATA})
    events += run(detector, range(15, 30, 5), {})  # back in step
    events += run(detector, range(30, 45, 5), {2: SLOW_DATA})
    assert events == []


def test_one_slow_window_of_many_steps_names_nobody() -> None:
    # Fast steps, a read a second: 50 steps a window. A pause of rank 1 (a collection, a
    # write) makes one window's average slow: no straggler, however many steps it spans.
    detector = Stragglers(factor=1.2, steps=20)
    events = run(detector, range(0, 150, 50), {})
    events += run(detector, range(150, 200, 50), {1: SLOW_DATA})
    events += run(detector, range(200, 400, 50), {})
    assert events == []
    events = run(detector, range(400, 550, 50), {1: SLOW_DATA})  # slow window after window
    assert [(e["kind"], e["step"]) for e in events] == [("straggler", 450)]


def test_a_rank_within_the_factor_is_not_slow() -> None:
    barely = {**FAST, "forward": 0.012}  # 1.13x the others
    assert run(Stragglers(factor=1.2, steps=5), range(0, 50, 5), {3: barely}) == []
    assert run(Stragglers(factor=1.1, steps=5), range(0, 50, 5), {3: barely}) != []


def test_recovery_is_said_once_after_steps_good_steps() -> None:
    detector = Stragglers(factor=1.2, steps=10)
    events = run(detector, range(0, 30, 5), {0: {**FAST, "optimizer": 0.05}})
    assert [(e["kind"], e["phase"]) for e in events] == [("straggler", "optimizer")]
    events = run(detector, range(30, 80, 5), {})
    assert [(e["kind"], e["rank"]) for e in events] == [("straggler-recovered", 0)]
    assert "rank 0 (node 0, host h0) has kept up with the others for 10 steps" in events[0]["text"]
    assert detector.now_slow == []


def test_reading_the_same_step_again_counts_nothing_twice() -> None:
    detector = Stragglers(factor=1.2, steps=20)
    for _ in range(50):  # a node's post read again and again, its ranks at step 5
        assert detector.judge(ranks(5, {1: SLOW_DATA}), attempt=0, now=0.0) == []


def test_zero_steps_turns_the_detector_off_and_one_rank_has_nobody_to_compare() -> None:
    assert run(Stragglers(steps=0), range(0, 100, 5), {1: SLOW_DATA}) == []
    alone = Stragglers(steps=1)
    assert alone.judge(ranks(5, {}, n=1), attempt=0, now=0.0) == []


def test_the_gpu_words_join_the_line() -> None:
    detector = Stragglers(factor=1.2, steps=5)
    gpu = {"index": 1, "throttle": ["power cap", "sync boost"], "other_processes": 2}
    seen = [
        Seen(0, 0, "h", 10, 0.01, FAST),
        Seen(1, 0, "h", 10, 0.05, SLOW_DATA, gpu),
    ]
    detector.judge([*seen[:1], Seen(1, 0, "h", 0, 0.05, SLOW_DATA, gpu)], 0, 0.0)
    (event,) = detector.judge(seen, attempt=0, now=1.0)
    assert event["text"].endswith(
        "; GPU 1: clocks throttled (power cap); 2 other process(es) on it"
    )
    assert gpu_words({"index": 0, "throttle": [], "other_processes": 0}) == ""
    assert gpu_words(None) == ""


def test_a_rank_record_without_a_window_is_not_judged() -> None:
    assert Seen.of({"rank": 0, "own_s": None, "phases_s": None}) is None
    seen = Seen.of(
        {"rank": 3, "node": 1, "host": "b", "step": 7, "own_s": 0.1, "phases_s": {"data": 0.05}}
    )
    assert seen is not None and seen.phases_s["forward"] == 0.0 and seen.node == 1


@pytest.mark.parametrize(
    ("factor", "steps", "message"),
    [
        (1.0, 20, "straggler_factor=1.0: give a number over 1"),
        (0.5, 20, "straggler_factor=0.5: give a number over 1"),
        ("fast", 20, "straggler_factor='fast': give a number over 1"),
        (float("nan"), 20, "straggler_factor=nan: give a number over 1"),
        (1.2, -1, "straggler_steps=-1: give a whole number of steps, 0 or more"),
        (1.2, 2.5, "straggler_steps=2.5: give a whole number of steps, 0 or more"),
        (1.2, "many", "straggler_steps='many': give a whole number of steps, 0 or more"),
    ],
)
def test_run_job_refuses_straggler_settings_that_cannot_work(
    factor: Any, steps: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        run_job(["true"], 1, straggler_factor=factor, straggler_steps=steps)


@pytest.mark.parametrize("total", [-1, 2.5, "200", True])
def test_run_job_refuses_a_total_of_steps_that_is_no_count(total: Any) -> None:
    with pytest.raises(ConfigError, match=r"total_steps=.*: give the run's steps \(0 or more\)"):
        run_job(["true"], 1, total_steps=total)


def test_settings_given_as_text_are_numbers() -> None:
    assert straggler_settings("1.5", "0") == (1.5, 0)
