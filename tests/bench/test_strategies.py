"""The strategies experiment: every registry strategy gets a row (with the reason when it
cannot run here), the rows and JSON keep their schema, and the plot is drawn. Timings are
checked for being there, never for their size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpukit._util.text import render_plain
from gpukit.bench import prediction, strategy_runs
from gpukit.bench import strategies as experiment
from gpukit.bench.result import BenchResult
from gpukit.devices import nvml
from gpukit.errors import ConfigError
from gpukit.strategies import STRATEGIES, SingleDevice
from tests.bench.conftest import BENCH_QUICK

pytestmark = BENCH_QUICK
KEYS = {c.key for c in experiment.COLUMNS}
TENSOR_KEYS = (
    "tensors_first",
    "tensors_others",
    "predicted_first",
    "predicted_others",
    "tensors_error",
)


@pytest.fixture
def quick(quick_strategies: BenchResult) -> BenchResult:
    """One quick run on this machine's CPU, shared by the tests that read it."""
    return quick_strategies


def by_config(result: BenchResult) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["workload"], r["strategy"], r["devices"]): r for r in result.rows}


@pytest.mark.processes
def test_quick_run_on_cpu_has_the_schema(quick: BenchResult) -> None:
    assert quick.experiment == "strategies" and quick.title == experiment.TITLE
    assert quick.keys == ("workload", "strategy", "devices")
    for row in quick.rows:
        assert set(row) >= {"workload", "strategy", "devices", "status"}
        assert set(row) - {"peak_others"} <= KEYS
    assert quick.environment["devices"][0]["device"] == "cpu"
    assert quick.parameters["quick"] is True and "cnn" in quick.parameters["quick_skipped"]
    assert quick.parameters["strategies"] == list(STRATEGIES)
    assert len(quick.raw["runs"]) == len(quick.rows)
    assert quick.notes and quick.summary
    back = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    assert back.rows == quick.rows
    assert "samples/s" in render_plain(back.table())


@pytest.mark.processes
def test_every_registry_strategy_has_a_row(quick: BenchResult) -> None:
    assert {r["strategy"] for r in quick.rows} == set(STRATEGIES)
    assert {r["workload"] for r in quick.rows} == {"gpt"}  # quick mode: one workload


@pytest.mark.processes
def test_what_cannot_run_here_says_why(quick: BenchResult) -> None:
    rows = by_config(quick)
    for name in ("dp", "dp-balanced"):
        row = rows[("gpt", name, 2)]
        assert row["status"] == "needs 2+ CUDA GPUs" and row.get("samples_per_s") is None


@pytest.mark.processes
def test_single_and_two_ddp_processes_run_on_the_cpu(quick: BenchResult) -> None:
    rows = by_config(quick)
    single, ddp1, ddp2 = (
        rows[("gpt", "single", 1)],
        rows[("gpt", "ddp", 1)],
        rows[("gpt", "ddp", 2)],
    )
    for row in (single, ddp1, ddp2):
        assert row["status"] == "ran"
        assert row["samples_per_s"] > 0 and row["efficiency"] > 0 and row["peak_first"] > 0
        assert row["gpu_util"] is None  # no GPU, no utilisation
    assert ddp1["efficiency"] == pytest.approx(1.0)  # its own 1-device rate
    assert ddp2["imbalance"] > 0 and ddp2["peak_others"] > 0  # both ranks' memory came back
    runs = {(r["strategy"], r["devices"]): r for r in quick.raw["runs"]}
    assert len(runs[("ddp", 2)]["memory"]) == 2 and runs[("ddp", 2)]["in_process"] is False
    assert runs[("ddp", 2)]["threads_per_process"] >= 1
    assert all(r["samples_per_s"] > 0 for r in runs[("single", 1)]["rounds"])


@pytest.mark.processes
def test_plot_writes_a_png_from_the_result_alone(quick: BenchResult, tmp_path: Path) -> None:
    path = tmp_path / "strategies.png"
    experiment.plot(BenchResult.from_dict(json.loads(json.dumps(quick.to_dict()))), path)
    assert path.stat().st_size > 1000


def test_plot_draws_memory_per_device_where_dp_ran(tmp_path: Path) -> None:
    gib = 2**30

    def run(strategy: str, peaks: list[float], in_process: bool = True) -> dict[str, Any]:
        memory = [{"device": f"cuda:{i}", "peak": int(p * gib)} for i, p in enumerate(peaks)]
        return {
            "workload": "gpt",
            "strategy": strategy,
            "devices": len(peaks),
            "status": "ran",
            "memory": memory,
            "in_process": in_process,
        }

    runs = [run("dp", [6, 3]), run("dp-balanced", [4, 3]), run("ddp", [3, 3], False)]
    rows = [
        {
            "workload": "gpt",
            "strategy": r["strategy"],
            "devices": 2,
            "samples_per_s": 1e4,
            "status": "ran",
        }
        for r in runs
    ] + [{"workload": "cnn", "strategy": "dp", "devices": 2, "status": "failed: boom"}]
    result = BenchResult(
        "strategies",
        "t",
        ("workload",),
        experiment.COLUMNS,
        rows,
        raw={"runs": runs},
        environment={"device": "cuda:0", "device_name": "NVIDIA H100"},
    )
    assert [r["strategy"] for r in experiment._memory_runs(result)] == ["dp", "dp-balanced", "ddp"]
    path = tmp_path / "memory.png"
    experiment.plot(result, path)
    assert path.stat().st_size > 1000


def test_plan_on_gpus_runs_each_strategy_on_each_count() -> None:
    found = experiment.plan(["cnn"], ["cuda:0", "cuda:1", "cuda:2"], (1, 2, 3))
    counts = {}
    for p in found:
        counts.setdefault(p.strategy, []).append(p.count)
        assert p.reason is None and p.devices == tuple(f"cuda:{i}" for i in range(p.count))
    several = [1, 2, 3]
    assert counts == {
        "single": [1],
        "dp": several,
        "dp-balanced": several,
        "ddp": several,
        "fsdp": several,
    }


@pytest.mark.processes
def test_fsdp_runs_beside_ddp_and_holds_about_half_the_state_per_rank(quick: BenchResult) -> None:
    rows = by_config(quick)
    ddp, fsdp = rows[("gpt", "ddp", 2)], rows[("gpt", "fsdp", 2)]
    assert fsdp["status"] == "ran" and fsdp["samples_per_s"] > 0 and fsdp["peak_first"] > 0
    assert fsdp["imbalance"] > 0 and fsdp["peak_others"] > 0  # both ranks' memory came back
    # After the last step (gradients set to None): the weights and AdamW's two moments,
    # whole on every ddp rank (plus a 4-byte step counter per parameter).
    from gpukit.workloads import load_workload

    weights = sum(p.numel() * p.element_size() for p in load_workload("gpt").model.parameters())
    assert ddp["state_rank"] * experiment.MiB == pytest.approx(3 * weights, rel=1e-3)
    # fsdp: each rank holds its shards, half of each tensor (the first rank's rounded up).
    assert 1.5 * weights <= fsdp["state_rank"] * experiment.MiB < 0.55 * 3 * weights
    runs = {(r["strategy"], r["devices"]): r for r in quick.raw["runs"]}
    assert len(runs[("fsdp", 2)]["model_state"]) == 2 and not runs[("fsdp", 2)]["in_process"]


def test_a_strategy_added_to_the_registry_joins_by_itself(monkeypatch) -> None:
    class Solo(SingleDevice):
        name = "solo"

    monkeypatch.setitem(STRATEGIES, "solo", Solo)
    assert ("solo", 1) in [(p.strategy, p.count) for p in experiment.plan(["gpt"], [], (1, 2))]


def test_a_configuration_that_fails_is_a_row_not_a_crash(monkeypatch) -> None:
    def broken(p: experiment.Planned, s: experiment.StrategySweep) -> None:
        raise RuntimeError("boom: the details")

    monkeypatch.setattr(strategy_runs, "measure_configuration", broken)
    result = experiment.run(quick=True, devices=[torch.device("cpu")])
    ran = [r for r in result.rows if r["status"] != "needs 2+ CUDA GPUs"]
    assert ran and all(r["status"] == "failed: RuntimeError: boom" for r in ran)
    # Nothing measured, nothing predicted: the new columns are empty cells.
    shown = [c for c in result.columns if c.key in TENSOR_KEYS]
    assert len(shown) == len(TENSOR_KEYS)
    assert all(result.cell(r, c) == "-" for r in result.rows for c in shown)
    assert all("prediction" not in r for r in result.raw["runs"])
    assert all(
        r["status"] == "RuntimeError: boom: the details"
        for r in result.raw["runs"]
        if r["status"].startswith("RuntimeError")
    )


def test_efficiency_falls_back_to_a_one_device_strategy() -> None:
    rows = [
        {"workload": "gpt", "strategy": "single", "devices": 1, "samples_per_s": 100.0},
        {"workload": "gpt", "strategy": "ddp", "devices": 2, "samples_per_s": 150.0},
        {"workload": "gpt", "strategy": "dp", "devices": 1, "samples_per_s": 80.0},
        {"workload": "gpt", "strategy": "dp", "devices": 2, "samples_per_s": 120.0},
    ]
    experiment._add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.75, 1.0, 0.75])


@pytest.mark.parametrize(
    "devices",
    [
        [],
        [torch.device("meta")],
        "cuda:0",
        [torch.device("cuda", 0)] * 2,
        [torch.device("cuda"), torch.device("cuda", 0)],  # the current GPU is cuda:0 here
    ],
)
def test_bad_devices_are_a_config_error(devices: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"(no device .* here|no devices given|give a list of devices)"
    ):
        experiment.run(quick=True, devices=devices)


@pytest.mark.gpu
@pytest.mark.processes  # with a second GPU, its two-GPU rows start DDP's ranks
def test_quick_run_on_one_gpu() -> None:
    result = experiment.run(quick=True, devices=[torch.device("cuda", 0)])
    rows = by_config(result)
    single = rows[("gpt", "single", 1)]
    assert single["status"] == "ran" and single["samples_per_s"] > 0 and single["peak_first"] > 0
    if nvml.read().available:  # the sample taken as the run ends lies in its span
        assert single["gpu_util"] is not None
    # The allocator's max allocated beside the prediction in its 512-byte blocks; no bound on
    # the error here: CUDA libraries may allocate workspaces through the same allocator.
    assert single["tensors_first"] > 0 and single["predicted_first"] > 0
    assert result.raw["runs"][0]["prediction"]["peaks"][0] % 512 == 0
    for name in ("dp", "dp-balanced", "ddp"):
        assert rows[("gpt", name, 1)]["status"] == "ran"
        if torch.cuda.device_count() < 2:
            assert rows[("gpt", name, 2)]["status"].startswith("needs 2 CUDA GPUs")


@pytest.mark.multigpu
@pytest.mark.processes  # DDP on two GPUs starts its ranks
def test_dp_balanced_holds_less_on_the_first_gpu_than_dp(tmp_path: Path) -> None:
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    result = experiment.run(quick=True, devices=gpus)
    rows = by_config(result)
    dp, balanced, ddp = (rows[("gpt", n, 2)] for n in ("dp", "dp-balanced", "ddp"))
    assert dp["status"] == balanced["status"] == ddp["status"] == "ran"
    assert balanced["peak_first"] < dp["peak_first"]
    assert balanced["imbalance"] < dp["imbalance"]
    experiment.plot(result, tmp_path / "strategies.png")
    assert (tmp_path / "strategies.png").stat().st_size > 1000


@pytest.mark.processes
def test_peak_tensors_come_back_from_runs_here_and_from_launches(quick: BenchResult) -> None:
    runs = {(r["strategy"], r["devices"]): r for r in quick.raw["runs"]}
    for key, count in ((("single", 1), 1), (("ddp", 2), 2), (("fsdp", 2), 2)):
        memory = runs[key]["memory"]
        assert len(memory) == count and all(m["peak_tensors"] > 0 for m in memory)
    assert runs[("single", 1)]["in_process"] and not runs[("ddp", 2)]["in_process"]


@pytest.mark.processes
def test_the_prediction_matches_the_measurement_on_the_cpu(quick: BenchResult) -> None:
    rows = by_config(quick)
    runs = {(r["strategy"], r["devices"]): r for r in quick.raw["runs"]}
    for strategy, count in (("single", 1), ("ddp", 1), ("ddp", 2)):
        row = rows[("gpt", strategy, count)]
        assert row["tensors_first"] > 1 and abs(row["tensors_error"]) <= 1.0
        assert row["predicted_first"] == pytest.approx(row["tensors_first"], rel=0.01)
        found = runs[(strategy, count)]["prediction"]
        # The run's own micro-batch (16 per device in quick mode) and precision.
        assert found["method"] == "simulation" and found["note"] is None
        assert (found["micro_batch"], found["precision"]) == (16, "32")
    ddp2, single = rows[("gpt", "ddp", 2)], rows[("gpt", "single", 1)]
    assert ddp2["predicted_others"] == pytest.approx(ddp2["tensors_others"], rel=0.01)
    assert single["tensors_others"] is None and single["predicted_others"] is None
    # fsdp: gloo's thread may free a gathered block a moment late (see gpukit.bench.plan).
    fsdp = rows[("gpt", "fsdp", 2)]
    assert fsdp["tensors_others"] > 0 and abs(fsdp["tensors_error"]) < 5
    for name in ("dp", "dp-balanced"):
        assert all(rows[("gpt", name, 2)].get(k) is None for k in TENSOR_KEYS)
    titles = {c.title for c in quick.columns}
    assert {"tensors 1st (MiB)", "predicted 1st (MiB)", "error (%)"} <= titles
    assert "largest prediction error on gpt" in quick.summary
    assert not [c.key for c in quick.columns if c.key.startswith("predicted") and c.compare]


def test_a_prediction_that_fails_keeps_the_measurement(monkeypatch) -> None:
    seen = {}

    def measured(p: experiment.Planned, s: experiment.StrategySweep) -> tuple[Any, Any]:
        memory = [{"device": "cpu", "peak": 9 * experiment.MiB, "peak_tensors": 3 * experiment.MiB}]
        last = {
            "micro_batch": 5,
            "precision": "bf16-mixed",
            "memory": memory,
            "utilization": {},
            "model_state": [1],
        }
        return [{"samples_per_s": 10.0}], last

    def simulate(workload: str, **shape: Any) -> None:
        seen.update(shape)
        raise RuntimeError("boom")

    monkeypatch.setattr(strategy_runs, "measure_configuration", measured)
    monkeypatch.setattr(prediction, "simulate", simulate)
    planned = experiment.Planned("gpt", "single", 1, ("cpu",))
    row, raw = experiment._configuration(planned, experiment.settings(quick=True, gpus=0))
    assert (seen["micro_batch"], seen["precision"]) == (5, "bf16-mixed")  # as the run ran
    assert row["status"] == "ran" and row["tensors_first"] == 3.0
    assert row["predicted_first"] is None and row["tensors_error"] is None
    assert raw["prediction"]["error"] == "RuntimeError: boom"
