"""The precision experiment: every variant gets a row (with the reason when it cannot run
here), variants start from the same weights and batches, the final loss is compared with
fp32's, and the plot is drawn. Timings are checked for being there, never for their size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from gpukit._util.text import render_plain
from gpukit.bench import precision as experiment
from gpukit.bench import precision_trainer
from gpukit.bench.result import BenchResult
from gpukit.errors import ConfigError
from gpukit.workloads import load_workload
from tests.bench.conftest import BENCH_QUICK

CPU = torch.device("cpu")
pytestmark = BENCH_QUICK
KEYS = {c.key for c in experiment.COLUMNS}


@pytest.fixture
def quick(quick_precision: BenchResult) -> BenchResult:
    """One quick run on this machine's CPU, shared by the tests that read it."""
    return quick_precision


def rows_of(result: BenchResult, device: str = "cpu") -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["workload"], r["variant"]): r for r in result.rows if r["device"] == device}


def test_quick_run_on_cpu_has_the_schema(quick: BenchResult) -> None:
    assert quick.experiment == "precision" and quick.title == experiment.TITLE
    assert quick.keys == ("device", "workload", "variant")
    for row in quick.rows:
        assert set(row) <= KEYS and {"device", "workload", "variant", "status"} <= set(row)
    assert quick.parameters["quick"] is True and "compile" in quick.parameters["quick_skipped"]
    assert quick.environment["devices"][0]["device"] == "cpu"
    assert len(quick.raw["runs"]) == len(quick.rows) and quick.notes and quick.summary
    back = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    assert back.rows == quick.rows
    assert "x fp32" in render_plain(back.table())


def test_every_variant_has_a_row_channels_last_on_images_only(quick: BenchResult) -> None:
    rows = rows_of(quick)
    names = [v.name for v in experiment.VARIANTS]
    assert [v for w, v in rows if w == "cnn"] == names
    assert [v for w, v in rows if w == "gpt"] == [n for n in names if "channels_last" not in n]


def test_what_cannot_run_on_the_cpu_says_why(quick: BenchResult) -> None:
    rows = rows_of(quick)
    for workload in ("cnn", "gpt"):
        fp16 = rows[(workload, "16-mixed")]
        assert "needs a CUDA GPU" in fp16["status"] and fp16.get("samples_per_s") is None
        for name in ("compile", "bf16-mixed + compile"):
            assert rows[(workload, name)]["status"].startswith("skipped: compiling for a CPU")


def test_faster_precisions_still_train_and_show_their_loss_difference(quick: BenchResult) -> None:
    rows = rows_of(quick)
    for workload in ("cnn", "gpt"):
        fp32, bf16 = rows[(workload, "fp32")], rows[(workload, "bf16-mixed")]
        assert fp32["status"] == bf16["status"] == "ran"
        assert fp32["speedup"] == 1.0 and fp32["loss_delta"] == 0.0
        assert bf16["samples_per_s"] > 0 and bf16["speedup"] > 0
        assert math.isfinite(bf16["final_loss"])
        assert bf16["loss_delta"] == pytest.approx(bf16["final_loss"] - fp32["final_loss"])
        assert abs(bf16["loss_delta"]) < 0.5  # rounding, not a model that stopped training
    assert rows[("cnn", "channels_last")]["status"] == "ran"


def test_the_same_seed_gives_the_same_final_loss() -> None:
    s = experiment.PrecisionTiming(warmup=1, steps=2, rounds=2, cpu_batch=None)
    first = precision_trainer.train(CPU, "cnn", experiment.BASELINE, 8, s)[1]
    second = precision_trainer.train(CPU, "cnn", experiment.BASELINE, 8, s)[1]
    assert first == second and math.isfinite(first)


@pytest.mark.parametrize("fails_after", [0, 2])  # while compiling (warm-up), or timed
def test_a_variant_that_fails_is_a_row_not_a_crash(monkeypatch, fails_after: int) -> None:
    def compile_that_fails(model: Any, **kwargs: Any) -> Any:
        calls = []

        def forward(x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) > fails_after:
                raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")
            return model(x)

        return forward

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    s = experiment.PrecisionTiming(warmup=1, steps=2, rounds=2, cpu_batch=None)
    variant = experiment.Variant("compile", "32", compile=True)
    (base, _), (row, raw) = experiment.compare(CPU, "mlp", [experiment.BASELINE, variant], 8, s)
    assert base["status"] == "ran" and base["speedup"] == 1.0
    assert (
        row["status"] == "failed: RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    )
    assert "more" in raw["status"] and row.get("samples_per_s") is None


def test_plot_writes_a_png_from_the_result_alone(quick: BenchResult, tmp_path: Path) -> None:
    path = tmp_path / "precision.png"
    experiment.plot(BenchResult.from_dict(json.loads(json.dumps(quick.to_dict()))), path)
    assert path.stat().st_size > 1000


@pytest.mark.parametrize("devices", [[], [torch.device("meta")], "cpu", [None]])
def test_bad_devices_are_a_config_error(devices: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"(no device .* here|no devices given|give a list of devices)"
    ):
        experiment.run(quick=True, devices=devices)


@pytest.mark.gpu
@pytest.mark.processes  # the compiled variants start inductor's pool of compile workers
def test_every_variant_trains_on_a_gpu(tmp_path: Path) -> None:
    # Which variant is fastest is the benchmark's answer, not a test's: the quick gpt is small
    # enough to be bound by kernel launches, where bf16's casts cost more than they save
    # (0.86x fp32 on an H200). What must hold on any GPU: every variant runs, compiled ones
    # included, and learns: its final loss is below a uniform guess over the characters.
    # 16-mixed only has to stay finite: it skips its first steps while the scaler finds its
    # scale, and in a quick run its loss trailed fp32's by 0.93 on an H200.
    gpu = torch.device("cuda", 0)
    result = experiment.run(quick=True, devices=[gpu])
    rows = rows_of(result, "cuda:0")
    guess = math.log(len(load_workload("gpt", seed=0).dataset.vocab))
    names = ["fp32", "16-mixed", "compile"]
    if torch.cuda.is_bf16_supported():
        names += ["bf16-mixed", "bf16-mixed + compile"]
    for name in names:
        row = rows[("gpt", name)]
        assert row["status"] == "ran", (name, row["status"])
        assert math.isfinite(row["samples_per_s"]) and row["samples_per_s"] > 0
        assert math.isfinite(row["final_loss"]), (name, row)
        assert name == "16-mixed" or row["final_loss"] < guess, (name, row)
    experiment.plot(result, tmp_path / "precision.png")
    assert (tmp_path / "precision.png").stat().st_size > 1000
