"""gk.plan and `gpukit plan`: every case planned, the layers chosen and said, bad input refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError
from gpukit.planning import planner
from gpukit.planning.simulate import simulate

GiB = 2**30


def test_plans_every_strategy_and_count_with_the_simulation_where_it_runs() -> None:
    report = gk.plan("mlp", devices=[1, 2], target="cpu")
    got = [(p.strategy, p.devices, p.method) for p in report.plans]
    assert got == [
        ("single", 1, "simulation"),
        ("dp", 2, "closed-form"),
        ("dp-balanced", 2, "closed-form"),
        ("ddp", 1, "simulation"),
        ("ddp", 2, "simulation"),
        ("fsdp", 1, "simulation"),
        ("fsdp", 2, "simulation"),
    ]
    fsdp2 = report.plans[-1]
    assert (
        fsdp2.peak_bytes
        == simulate("mlp", strategy="fsdp", devices=2, micro_batch=32)[0].peak_bytes
    )
    assert any("dp: closed form" in n for n in report.plans[1].notes)
    assert report.plans[1].per_device[0].peak_bytes > report.plans[1].per_device[1].peak_bytes


def test_a_gpu_target_adds_the_context_and_the_reserve_and_rounds_to_512() -> None:
    cpu = gk.plan("mlp", devices=1, strategies=["single"], target="cpu").plans[0]
    gpu = gk.plan("mlp", devices=1, strategies=["single"], target="h100", precision="32").plans[0]
    part = gpu.per_device[0].breakdown
    assert part["cuda_context"] > 0 and part["allocator_reserve"] > 0
    assert gpu.per_device[0].tensor_bytes % 512 == 0
    assert gpu.per_device[0].tensor_bytes >= cpu.per_device[0].tensor_bytes
    assert (
        gpu.precision == "32" and gk.plan("mlp", target="h100").plans[0].precision == "bf16-mixed"
    )


def test_largest_micro_batch_fits_and_one_more_would_not() -> None:
    cap = 200_000  # the mlp holds ~130 KB of model states, and ~380 bytes more per sample
    (plan,) = gk.plan("mlp", devices=1, strategies=["single"], target="cpu", memory=cap).plans
    largest = plan.largest_micro_batch
    assert largest is not None and largest > plan.micro_batch
    fits = simulate("mlp", strategy="single", devices=1, micro_batch=largest)[0].peak_bytes
    over = simulate("mlp", strategy="single", devices=1, micro_batch=largest + 1)[0].peak_bytes
    assert fits <= cap < over


def test_when_the_batch_does_not_fit_the_recommendation_accumulates() -> None:
    report = gk.plan(
        "mlp", devices=[1], strategies=["single"], batch=1024, target="cpu", memory=600_000
    )
    plan = report.plans[0]
    assert plan.fits is False and plan.largest_micro_batch
    best = report.best
    assert best is not None and best.micro_batch * best.accumulate == 1024
    assert best.micro_batch <= plan.largest_micro_batch
    assert f"accumulate {best.accumulate}" in report.recommendation


def test_json_lists_the_plans_with_peak_bytes_per_device_and_fits(capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--workload",
                "mlp",
                "--devices",
                "1,2",
                "--strategies",
                "single,ddp,fsdp",
                "--target",
                "cpu",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert [(p["strategy"], p["devices"]) for p in out["plans"]] == [
        ("single", 1),
        ("ddp", 1),
        ("ddp", 2),
        ("fsdp", 1),
        ("fsdp", 2),
    ]
    for p in out["plans"]:
        assert p["peak_bytes"] == max(d["peak_bytes"] for d in p["per_device"])
        assert set(p) >= {"micro_batch", "breakdown", "step_time_s", "fits", "per_device"}
    assert out["recommendation"]


def test_the_table_names_the_recommendation(capsys) -> None:
    assert main(["plan", "--workload", "mlp", "--devices", "2", "--target", "a100"]) == 0
    text = capsys.readouterr().out
    assert "Plan for mlp on A100" in text and "recommendation:" in text


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"devices": 0}, "device count"),
        ({"devices": [1, "2"]}, "device count"),
        ({"strategies": ["zero3"]}, "choose among"),
        ({"batch": 0}, "batch=0"),
        ({"accumulate": -1}, "accumulate=-1"),
        ({"precision": "fp8"}, "precision"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing"),
        ({"method": "guess"}, "method"),
        ({"target": "tpu"}, "unknown target"),
        ({"batch": 3, "devices": 2, "strategies": ["ddp"]}, "does not split"),
    ],
)
def test_bad_input_is_refused_with_what_is_allowed(kwargs: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        gk.plan("mlp", **kwargs)


@pytest.mark.parametrize(
    "argv",
    [["--devices", "two"], ["--devices", ""], ["--memory", "lots"], ["--workload", "nope"]],
)
def test_cli_bad_input_exits_2(argv: list[str], capsys) -> None:
    assert main(["plan", *argv]) == 2
    assert "error:" in capsys.readouterr().err


def test_largest_micro_batch_is_exact_for_fsdp_on_two() -> None:
    cap = 2**30
    plan = gk.plan("gpt", devices=2, strategies=["fsdp"], target="cpu", memory=cap).plans[0]
    largest = plan.largest_micro_batch
    at = simulate("gpt", strategy="fsdp", devices=2, micro_batch=largest)[0].peak_bytes
    above = simulate("gpt", strategy="fsdp", devices=2, micro_batch=largest + 1)[0].peak_bytes
    assert at <= cap < above


def test_a_batch_that_does_not_fit_is_planned_again_in_smaller_micro_batches() -> None:
    cap = 2 * 2**20
    report = gk.plan("mlp", batch=4096, devices=1, strategies=["single"], target="cpu", memory=cap)
    (asked,) = report.plans
    (again,) = report.fitted
    assert asked.fits is False and again.fits is True
    assert again.micro_batch * again.accumulate == 4096 and again.accumulate > 1
    twice = simulate(
        "mlp",
        strategy="single",
        devices=1,
        micro_batch=again.micro_batch,
        accumulate=again.accumulate,
    )
    assert again.peak_bytes == twice[0].peak_bytes <= cap
    # Planned again, its own largest micro-batch is searched at its accumulation (which holds
    # the gradients between micro-steps): it fits, and one more sample does not.
    largest = again.largest_micro_batch
    assert largest is not None and largest >= again.micro_batch
    at, above = (
        simulate("mlp", strategy="single", devices=1, micro_batch=m, accumulate=again.accumulate)[
            0
        ].peak_bytes
        for m in (largest, largest + 1)
    )
    assert at <= cap < above
    assert report.best == again
    assert (
        f"micro-batch {again.micro_batch}, accumulate {again.accumulate}" in report.recommendation
    )


def test_checkpointing_is_planned_for_fsdp_only() -> None:
    assert [
        p.strategy
        for p in gk.plan("mlp", devices=2, activation_checkpointing="full", target="cpu").plans
    ] == ["fsdp"]
    with pytest.raises(ConfigError, match="fsdp setting"):
        gk.plan("mlp", devices=2, strategies=["ddp"], activation_checkpointing="full")


def test_a_calibration_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match="calibrate"):
        gk.plan("mlp", calibration="fast")  # type: ignore[arg-type]


def test_a_plan_planned_again_that_still_does_not_fit_is_cut_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Accumulating loads the step's whole batch at once, and the mlp's batch of 4096 is 1 MiB
    # of inputs: at 1 MiB each cut holds more than the line of the one before predicted.
    # Two rounds show a cut cut again (a third would simulate 32 micro-steps per step).
    monkeypatch.setattr(planner, "FIT_ROUNDS", 2)
    cap = 2**20
    report = gk.plan("mlp", batch=4096, devices=1, strategies=["single"], target="cpu", memory=cap)
    (asked,) = report.plans
    (again,) = report.fitted
    assert asked.largest_micro_batch is not None
    first_cut = max(m for m in range(1, asked.largest_micro_batch + 1) if not 4096 % m)
    assert again.micro_batch < first_cut  # cut again, by its own largest micro-batch
    assert again.micro_batch * again.accumulate == 4096 and again.fits is False
    assert report.best is None
    assert (
        f"at micro-batch {again.micro_batch}, accumulate {again.accumulate}; micro-batch "
        f"{again.largest_micro_batch} fits at that accumulation" in report.recommendation
    )


def test_a_second_cut_fits_where_the_first_held_the_gradients_between_micro_steps() -> None:
    # gpt's batch of 48 on 15.5 MiB: 24 samples fit in one step, but with two micro-steps the
    # gradients stay between them and 24 no longer fits; cut again by the largest at that
    # accumulation (23), the batch divides into 3 micro-batches of 16. (A batch whose second
    # cut has few micro-steps: each micro-step of each simulated step costs its own forward.)
    cap = 31 * 2**19
    report = gk.plan("gpt", batch=48, devices=1, strategies=["single"], target="cpu", memory=cap)
    (asked,) = report.plans
    assert asked.largest_micro_batch == 24
    (again,) = report.fitted
    assert (again.micro_batch, again.accumulate, again.fits) == (16, 3, True)
    at_two = simulate("gpt", strategy="single", devices=1, micro_batch=24, accumulate=2)
    assert at_two[0].peak_bytes > cap  # the first cut, (24, 2), would not have fitted
    assert report.best == again


def test_nothing_fits_says_so_with_the_smallest_peak() -> None:
    report = gk.plan("mlp", target="cpu", memory=1000, method="closed-form")
    assert report.best is None
    assert report.recommendation.startswith("nothing planned fits in 1000 B")
    assert "not even one sample per micro-batch fits" in report.recommendation


@pytest.mark.parametrize(
    "argv", [["--devices", "1,,2"], ["--strategies", ""], ["--memory", "1e400"]]
)
def test_more_cli_bad_input_exits_2(argv: list[str], capsys) -> None:
    assert main(["plan", "--target", "cpu", "--method", "closed-form", *argv]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "peak",
    [
        lambda m: max(500_000, 100_000 + 3_000 * m),  # the optimizer step peaks first: flat
        lambda m: 50_000 + 900 * m + (40_000 + 2_500 * (m - 300) if m > 300 else 0),
        lambda m: 200_000 + 7 * m,
    ],
)
@pytest.mark.parametrize("capacity", [150_000, 499_999, 600_000, 1_000_000])
def test_the_search_finds_the_largest_micro_batch_of_any_rising_peak(
    monkeypatch: pytest.MonkeyPatch, peak: Callable[[int], int], capacity: int
) -> None:
    # The search itself, over peaks of known shape: it must land exactly where a search of
    # every micro-batch would (0 when not even one sample fits).
    from gpukit.planning import planner, search
    from gpukit.planning.result import DevicePeak

    asked: list[int] = []

    def peaks(subject: object, strategy: str, n: int, micro: int, notes: list[str]) -> Any:
        asked.append(micro)
        return (DevicePeak("cpu", {"activations": peak(micro)}),), "simulation"

    monkeypatch.setattr(planner, "_peaks", peaks)
    (plan,) = gk.plan("mlp", devices=1, strategies=["single"], target="cpu", memory=capacity).plans
    every = [m for m in range(1, 200_000) if peak(m) <= capacity]
    truth = max(every, default=0)
    assert plan.largest_micro_batch == truth, (asked, plan.notes)
    assert truth == 0 or truth in asked  # the answer was predicted, not extrapolated
    assert len(asked) <= 2 + search.SEARCH_STEPS
