"""Calibrated step time: which cases are measured here, the measured line used whole for a
strategy on several devices, the plan's wording of its step time's source, and a meta-device
workload (materialised for the real steps, or refused when too large). No wall-clock
assertions: timers are injected or only counted."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from gpukit.cli.__main__ import main
from gpukit.devices import hw
from gpukit.errors import ConfigError
from gpukit.planning import calibrate_runs
from gpukit.planning.calibrate import Calibration, Line, calibrate
from gpukit.planning.planner import plan
from gpukit.planning.timing_notes import DATASHEET

META = """
import torch
from torch import nn
from gpukit.workloads import Workload


def make(seed=0):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    return Workload("tiny-meta", model, data, nn.CrossEntropyLoss(), 16, 1e-3, 1, 0.0)
"""


def fake_calibration(*lines: Line) -> Calibration:
    return Calibration(
        device="cpu",
        device_name="test cpu",
        precision="32",
        micro_batches=(32, 64),
        step_seconds=(0.02, 0.03),
        seconds_per_sample=3.125e-4,
        fixed_seconds=0.01,
        measured_peak_tensors=(1, 2),
        reserve_fraction=0.0,
        context_bytes=0,
        lines=lines,
    )


def test_cases_measured_here_are_multi_device_strategies_within_the_machine() -> None:
    cases = [
        ("single", 1),
        ("single", 2),
        ("ddp", 1),
        ("ddp", 2),
        ("fsdp", 2),
        ("dp", 2),
        ("dp-balanced", 2),
        ("ddp", 3),
        ("ddp", 2),
        ("nonsense", 2),
    ]
    here = calibrate_runs.cases_here(cases, kind="cpu", available=2)
    assert here == [("ddp", 2), ("fsdp", 2), ("dp", 2), ("dp-balanced", 2)]
    assert calibrate_runs.micro_sizes(64) == (32, 64) and calibrate_runs.micro_sizes(1) == (1, 2)


def test_a_measured_line_is_the_step_time_of_its_strategy_and_count() -> None:
    ddp = Line("ddp", 2, (16, 32), (0.05, 0.07), 0.03, 0.00125)
    cal = fake_calibration(ddp)
    assert cal.line("ddp", 2) is ddp and cal.line("fsdp", 2) is None
    assert cal.line("single", 1) == Line("single", 1, (32, 64), (0.02, 0.03), 0.01, 3.125e-4)
    report = plan(
        "mlp",
        devices=[1, 2],
        strategies=["single", "ddp", "fsdp"],
        calibration=cal,
        method="closed-form",
    )
    by = {(p.strategy, p.devices): p for p in report.plans}
    measured = by[("ddp", 2)]
    assert measured.micro_batch == 32
    assert measured.step_time is not None
    assert measured.step_time.total_s == pytest.approx(ddp.at(32))
    # one device's compute and host, the rest communication
    assert measured.step_time.compute_s == pytest.approx(3.125e-4 * 32)
    assert measured.step_time.host_s == pytest.approx(0.01)
    single = by[("single", 1)].step_time
    assert single is not None and single.total_s == pytest.approx(0.01 + 3.125e-4 * 64)
    assert any(n.startswith("step time: calibrated") for n in measured.notes)
    assert any("extrapolated from the one-device calibration" in n for n in by[("fsdp", 2)].notes)
    assert all(DATASHEET not in p.notes for p in report.plans)


def test_without_calibration_every_plan_says_its_step_time_is_a_datasheet_estimate() -> None:
    report = plan("mlp", devices=[1, 2], strategies=["single", "ddp"], method="closed-form")
    assert report.plans and all(DATASHEET in p.notes for p in report.plans)
    assert "datasheet estimate" in str(report)
    assert "datasheet estimate" in str(report.to_dict()["plans"][0]["notes"])


def test_plan_cli_says_datasheet_without_calibrate_and_not_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    argv = [
        "plan",
        "--workload",
        "mlp",
        "--devices",
        "1,2",
        "--strategies",
        "single,ddp",
        "--method",
        "closed-form",
    ]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    assert "datasheet estimate" in out.getvalue()
    asked: list[object] = []

    def fake_plan_calibration(workload: str, cases: list[tuple[str, int]], **kw: object) -> object:
        asked.append((workload, cases, kw))
        return fake_calibration(Line("ddp", 2, (16, 32), (0.05, 0.07), 0.03, 0.00125))

    monkeypatch.setattr(calibrate_runs, "calibrate_plan", fake_plan_calibration)
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*argv, "--calibrate"]) == 0
    assert "datasheet" not in out.getvalue() and "calibrated" in out.getvalue()
    # every strategy asked on every count asked: the calibration picks what runs here
    (workload, cases, _) = asked[0]  # type: ignore[misc]
    assert workload == "mlp" and ("ddp", 2) in cases and ("single", 1) in cases


def test_calibrate_with_another_target_is_refused_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    measured: list[object] = []
    monkeypatch.setattr(calibrate_runs, "calibrate_plan", lambda *a, **k: measured.append(a))
    argv = ["plan", "--workload", "mlp", "--target", "h100", "--calibrate"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--calibrate measures steps on this machine" in err and "--target is H100" in err
    assert measured == []


def test_calibrating_a_meta_workload_materialises_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tiny_meta_wl.py").write_text(META)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []

    def timer(run: object, b: int) -> float:
        seen.append(b)
        return 0.01 + 0.001 * b

    cal = calibrate("tiny_meta_wl:make", micro_batches=(2, 4), steps=2, device="cpu", timer=timer)
    assert seen == [2, 2, 4, 4]
    assert cal.seconds_per_sample == pytest.approx(0.001)
    assert 0 < cal.measured_peak_tensors[0] <= cal.measured_peak_tensors[1]


def test_a_meta_workload_too_large_for_this_machine_is_refused_before_allocating() -> None:
    if (hw.ram_total() or 0) > 8.1e9 * 16:
        pytest.skip("this machine holds Llama 3 8B's training state")
    with pytest.raises(ConfigError, match="too large to calibrate here"):
        calibrate("gpukit.workloads.llama:llama3_8b", device="cpu")
    with pytest.raises(ConfigError, match="datasheet estimate"):
        calibrate_runs.calibrate_plan(
            "gpukit.workloads.llama:llama3_8b", [("ddp", 2)], device="cpu"
        )
