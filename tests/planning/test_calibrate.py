"""Calibration: the line fit, a real CPU run, and the CUDA arithmetic with mocked torch.cuda."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.planning import calibrate as cal_module
from gpukit.planning.calibrate import (
    calibrate,
    cuda_context_bytes,
    cuda_peaks,
    fit_line,
    reserve_fraction,
)
from gpukit.workloads.base import load_workload


def test_fit_recovers_a_line() -> None:
    fixed, per = fit_line([(4, 0.02 + 4 * 3e-4), (64, 0.02 + 64 * 3e-4), (16, 0.02 + 16 * 3e-4)])
    assert fixed == pytest.approx(0.02) and per == pytest.approx(3e-4)
    assert fit_line([(8, 0.05), (16, 0.04)]) == (pytest.approx(0.045), 0.0)  # noise: no speed-up
    with pytest.raises(ConfigError, match="two different sizes"):
        fit_line([(8, 0.1), (8, 0.2)])


def test_injected_timer_is_fitted() -> None:
    seen: list[int] = []

    def timer(run: object, b: int) -> float:
        seen.append(b)
        return 0.05 + 0.001 * b

    cal = calibrate("mlp", micro_batches=(4, 12), steps=2, device="cpu", timer=timer)
    assert seen == [4, 4, 12, 12]
    assert cal.fixed_seconds == pytest.approx(0.05) and cal.seconds_per_sample == pytest.approx(
        1e-3
    )
    assert cal.step_seconds == pytest.approx((0.054, 0.062))


def test_cpu_calibration_on_mlp_leaves_the_model_alone() -> None:
    workload = load_workload("mlp")
    before = {k: v.clone() for k, v in workload.model.state_dict().items()}
    # A large batch that shows in the peak above the model's states; a few timed steps, since
    # how the times split is not checked here.
    cal = calibrate(workload, micro_batches=(8, 4096), steps=2, device="cpu")
    assert cal.device == "cpu" and cal.precision == "32"
    # Only the bookkeeping: how the times split is a measurement, which a loaded machine
    # can bend (a hiccup in the small batch's steps fits a slope of 0).
    assert cal.seconds_per_sample >= 0 and cal.fixed_seconds >= 0
    assert len(cal.step_seconds) == 2 and all(s > 0 for s in cal.step_seconds)
    small, large = cal.measured_peak_tensors
    assert 0 < small < large
    # the model, its gradients, AdamW's two moments: at least 4x the weights at either size
    weights = sum(p.numel() * p.element_size() for p in workload.model.parameters())
    assert small >= 4 * weights
    # the larger batch holds 4088 more samples of input (32 floats) at the peak, at least
    assert large - small >= (4096 - 8) * 32 * 4
    assert cal.reserve_fraction == 0.0 and cal.context_bytes == 0
    after = workload.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in workload.model.parameters())


def test_a_bare_model_needs_data_and_loss() -> None:
    model = nn.Linear(3, 1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    cal = calibrate(
        model,
        dataset=data,
        loss=nn.MSELoss(),
        micro_batches=(2, 4),
        steps=1,
        device="cpu",
        timer=lambda run, b: 1.0 + b,
    )
    assert cal.seconds_per_sample == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="dataset="):
        calibrate(model, micro_batches=(2, 4), device="cpu")


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"micro_batches": (8, 8)}, "two different"),
        ({"micro_batches": (0, 8)}, "two different"),
        ({"micro_batches": (8,)}, "two different"),
        ({"steps": 0}, "steps=0"),
    ],
)
def test_bad_inputs(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        calibrate("mlp", device="cpu", **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="give a Workload"):
        calibrate(3.5, device="cpu")  # type: ignore[arg-type]


def test_reserve_fraction() -> None:
    assert reserve_fraction(1000, 1250) == 0.25
    assert reserve_fraction(1000, 900) == 0.0
    assert reserve_fraction(0, 100) == 0.0


def test_cuda_context_and_peaks_with_mocked_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    GiB = 2**30
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (70 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 4 * GiB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 5 * GiB)
    dev = torch.device("cuda", 0)
    assert cuda_context_bytes(dev) == 8 * GiB  # 80 - 70 free - 2 reserved by torch
    allocated, reserved = cuda_peaks(dev, lambda: calls.append("step"))
    assert (allocated, reserved) == (4 * GiB, 5 * GiB)
    assert calls == ["sync", "reset", "step", "sync"]
    assert reserve_fraction(allocated, reserved) == 0.25
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (79 * GiB, 80 * GiB))
    assert cuda_context_bytes(dev) == 0  # never negative
    assert cal_module.__all__  # the module's public names stay declared


@pytest.mark.gpu
def test_real_gpu_calibration() -> None:
    cal = calibrate("mlp", micro_batches=(8, 1024), steps=3, device="cuda")
    assert cal.device.startswith("cuda") and cal.seconds_per_sample >= 0
    assert 0 < cal.measured_peak_tensors[0] < cal.measured_peak_tensors[1]
    assert cal.context_bytes > 0 and cal.reserve_fraction >= 0.0
