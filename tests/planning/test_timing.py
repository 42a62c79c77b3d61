"""Step time: a hand-computed case, the monotone behaviours, calibration, bad inputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpukit.errors import ConfigError
from gpukit.planning.calibrate import Calibration
from gpukit.planning.targets import Target, target
from gpukit.planning.timing import HOST_SECONDS, step_time

# Round numbers, so the expected values can be worked out by hand.
ROUND = Target("round", "cuda", 10**10, {"fp32": 1e12}, 1e9, 1e-6, 0, 0.0)
MODEL = {"flops_per_sample": 4.5e9, "trainable_bytes": 10**9, "largest_group_bytes": 10**8}


def run(strategy: str, devices: int, **kw: Any) -> Any:
    args: dict[str, Any] = {"target": ROUND, "micro_batch": 10, "accumulate": 2, "precision": "32"}
    args.update(MODEL)
    args.update(kw)
    return step_time(strategy=strategy, devices=devices, **args)


def test_ddp_by_hand() -> None:
    t, per_s, mfu = run("ddp", 4)
    # one micro-step: 4.5e9 * 10 / (1e12 * 0.45) = 0.1 s; two of them
    assert t.compute_s == pytest.approx(0.2)
    # ring all-reduce of 1e9 bytes over 4: 2*3/4 * 1e9/1e9 + 2*3 * 1e-6, less the last
    # micro-step's backward (2/3 of 0.1 s) that hides it
    assert t.communication_s == pytest.approx(1.5 + 6e-6 - 0.2 / 3)
    assert t.host_s == pytest.approx(2 * HOST_SECONDS)
    total = 0.2 + 1.5 + 6e-6 - 0.2 / 3 + 2 * HOST_SECONDS
    assert per_s == pytest.approx(80 / total)
    assert mfu == pytest.approx(4.5e9 * 80 / (total * 4 * 1e12))


def test_fsdp_by_hand() -> None:
    t, _, _ = run("fsdp", 2, accumulate=1)
    # 10 blocks of 1e8 bytes; each gather over 2 moves half: 0.05 s + 1e-6
    block = 0.5 * 1e8 / 1e9 + 1e-6
    forward = max(10 * block - 0.1 / 3, block)
    backward = max(20 * block - 0.2 / 3, block)
    assert t.communication_s == pytest.approx(forward + backward)


def test_dp_by_hand() -> None:
    t, _, _ = run("dp", 2, accumulate=1, io_bytes_per_sample=10**6)
    # broadcast and reduce of 1e9 bytes to/from the other GPU, then half of 20 samples' io
    assert t.communication_s == pytest.approx(2 * (1.0 + 1e-6) + 0.5 * 2e7 / 1e9)
    assert t.host_s == pytest.approx(2 * HOST_SECONDS)  # one process drives both GPUs


@pytest.mark.parametrize("strategy", ["single", "dp", "dp-balanced", "ddp", "fsdp"])
def test_one_device_does_not_communicate(strategy: str) -> None:
    assert run(strategy, 1)[0].communication_s == 0.0


@pytest.mark.parametrize("strategy", ["dp", "ddp", "fsdp"])
def test_more_devices_less_compute_each_more_communication(strategy: str) -> None:
    h100 = target("h100")
    model = {"flops_per_sample": 6e9, "trainable_bytes": 4 * 10**9, "largest_group_bytes": 10**8}
    previous = None
    for n in (1, 2, 4, 8):  # the same global batch of 64 samples
        t, _, _ = step_time(
            target=h100,
            strategy=strategy,
            devices=n,
            micro_batch=64 // n,
            accumulate=1,
            precision="bf16-mixed",
            **model,
        )
        if previous is not None:
            assert t.compute_s < previous.compute_s
            # raw collectives grow with N; what is exposed can only grow as compute shrinks
            assert t.communication_s >= previous.communication_s
        previous = t


def test_fsdp_communicates_more_than_ddp() -> None:
    for n in (2, 4, 8):
        ddp, fsdp = run("ddp", n)[0], run("fsdp", n)[0]
        assert fsdp.communication_s > ddp.communication_s
    slow = dataclasses.replace(ROUND, link_bytes_per_s=1e6)
    assert (
        run("fsdp", 2, target=slow)[0].communication_s
        > run("ddp", 2, target=slow)[0].communication_s
    )


def test_precision_picks_the_peak() -> None:
    h100 = target("h100")
    times = {
        p: run("single", 1, target=h100, precision=p)[0].compute_s
        for p in ("32", "tf32", "bf16-mixed", "16-mixed")
    }
    assert times["32"] > times["tf32"] > times["bf16-mixed"] == times["16-mixed"]


def test_cpu_has_no_mfu_and_uses_its_estimate() -> None:
    t, per_s, mfu = run("ddp", 2, target=target("cpu"), precision="bf16-mixed")
    assert mfu is None and per_s > 0 and t.communication_s > 0


def test_calibration_replaces_the_assumptions() -> None:
    cal = Calibration("cuda:0", "round", "32", (8, 16), (0.03, 0.05), 0.0025, 0.01, (1, 2), 0.0, 0)
    t, _, _ = run("single", 1, calibration=cal)
    assert t.compute_s == pytest.approx(0.0025 * 10 * 2)
    assert t.host_s == pytest.approx(0.01 * 2)
    # a measurement needs no datasheet peak, nor a FLOP count
    t4 = target("t4")
    t2, _, mfu = run(
        "single", 1, target=t4, precision="bf16-mixed", calibration=cal, flops_per_sample=0.0
    )
    assert t2.compute_s == pytest.approx(t.compute_s) and mfu is None


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"strategy": "zero3"}, "use one of single"),
        ({"devices": 0}, "devices=0"),
        ({"strategy": "single", "devices": 2}, "runs on one device"),
        ({"micro_batch": 1.5}, "micro_batch"),
        ({"accumulate": True}, "accumulate"),
        ({"precision": "auto"}, "resolved by the Runtime"),
        ({"precision": "int8"}, "use one of 32"),
        ({"flops_per_sample": 0.0}, "flops_per_sample"),
        ({"flops_per_sample": float("nan")}, "flops_per_sample"),
        ({"trainable_bytes": -1}, "trainable_bytes"),
        ({"largest_group_bytes": 1.5}, "largest_group_bytes"),
        ({"target": target("t4"), "precision": "bf16-mixed"}, "no known bf16 peak"),
    ],
)
def test_bad_inputs(change: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"strategy": "ddp", "devices": 2}
    args.update(change)
    with pytest.raises(ConfigError, match=match):
        run(**args)
