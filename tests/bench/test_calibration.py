"""`gpukit bench calibration`: a row per workload x strategy with the calibrated and the
datasheet step time beside gpukit train's; the steady step read from metrics.csv. Counts and
structure only: no wall-clock assertion."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpukit.bench import calibration
from gpukit.planning.calibrate import Calibration, Line
from tests.bench.conftest import BENCH_QUICK


def row(step: int, elapsed: float, loss: str = "1.0", val: str = "") -> dict[str, str]:
    return {"step": str(step), "elapsed": str(elapsed), "loss": loss, "val_loss": val}


def test_steady_step_skips_the_first_steps_and_validation_spans() -> None:
    rows = [
        row(5, 1.0),
        row(10, 2.0),
        row(15, 2.5),
        row(15, 9.0, loss="", val="0.5"),
        row(20, 9.5),
        row(25, 10.0),
    ]
    # 5->10: 0.2 s/step; 10->15: 0.1; 15->20 holds the validation pass: left out; 20->25: 0.1
    assert calibration.steady_step(rows) == pytest.approx(0.1)
    assert calibration.steady_step([row(1, 0.5), row(2, 0.6)]) is None  # all in the skipped steps


def fake_calibrate_plan(workload: str, cases: list[tuple[str, int]], **_: Any) -> Calibration:
    lines = tuple(Line(s, n, (16, 32), (0.02, 0.03), 0.01, 6.25e-4) for s, n in cases if n > 1)
    return Calibration(
        "cpu", "test cpu", "32", (32, 64), (0.02, 0.03), 3.125e-4, 0.01, (1, 2), 0.0, 0, lines
    )


def test_a_row_per_workload_and_strategy_with_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[tuple[str, str, int, int]] = []

    def fake_train(workload: str, strategy: str, devices: int, steps: int) -> Any:
        trained.append((workload, strategy, devices, steps))
        return 0.025, [row(5, 1.0), row(10, 1.125)]

    monkeypatch.setattr(calibration, "calibrate_plan", fake_calibrate_plan)
    monkeypatch.setattr(calibration, "train_step_seconds", fake_train)
    result = calibration.run(steps=10, workloads=("mlp", "cnn"), repeats=2)
    cases = [(r["workload"], r["strategy"], r["devices"]) for r in result.rows]
    assert cases == [(w, s, n) for w in ("mlp", "cnn") for s, n in calibration.CASES]
    assert len(trained) == 20 and {t[3] for t in trained} == {10}  # alternated, twice
    single = result.rows[0]
    assert single["micro_batch"] == 64
    assert single["calibrated_s"] == pytest.approx(0.01 + 3.125e-4 * 64)
    assert single["calibrated_error"] == pytest.approx(100 * (0.03 - 0.025) / 0.025)
    assert all(r["datasheet_s"] > 0 and r["datasheet_error"] is not None for r in result.rows)
    assert result.summary["cases"] == 10 and "within_25_pct" in result.summary
    assert "train (s/step)" in str(result.table().columns[4].header)


@pytest.mark.processes
@pytest.mark.slow
@BENCH_QUICK
def test_quick_bench_prints_a_row_per_case(quick_calibration_printed: tuple[int, str]) -> None:
    code, printed = quick_calibration_printed
    assert code == 0
    data = json.loads(printed[printed.index("{\n") :])
    assert [(r["strategy"], r["devices"]) for r in data["rows"]] == list(calibration.QUICK_CASES)
    assert all(r["measured_s"] and r["calibrated_s"] for r in data["rows"])
