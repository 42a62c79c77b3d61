"""The planner's prediction beside a benchmark's measurement: the simulation where it runs,
the closed form where it cannot (with the reason), the run's own micro-batch and precision,
and a prediction that fails is an empty cell, never an exception."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from gpukit.bench import prediction
from gpukit.bench.prediction import MiB, predict, tensor_columns
from gpukit.planning.simulate import simulate


def test_single_ddp_and_fsdp_are_simulated_at_the_runs_micro_batch() -> None:
    for strategy, devices in (("single", ["cpu"]), ("ddp", ["cpu", "cpu"])):
        found = predict("mlp", strategy, devices, micro_batch=8, precision="32")
        assert found["method"] == "simulation" and found["note"] is None
        assert (found["micro_batch"], found["precision"]) == (8, "32")
        expected = simulate("mlp", strategy=strategy, devices=len(devices), micro_batch=8)
        assert found["peaks"] == [p.tensor_bytes for p in expected]
    sharded = predict("mlp", "fsdp", ["cpu", "cpu"], micro_batch=8, precision="32")
    assert sharded["method"] == "simulation" and len(sharded["peaks"]) == 2
    small = predict("mlp", "single", ["cpu"], micro_batch=8, precision="32")["peaks"][0]
    large = predict("mlp", "single", ["cpu"], micro_batch=64, precision="32")["peaks"][0]
    assert large > small  # the micro-batch given is the one simulated


def test_dp_falls_back_to_the_closed_form_with_the_simulations_reason() -> None:
    found = predict("mlp", "dp", ["cuda:0", "cuda:1"], micro_batch=8, precision="32")
    assert found["method"] == "closed-form" and "one process" in found["note"]
    first, other = found["peaks"]
    assert first > other > 0  # dp's first GPU holds the model state and the gathered outputs
    on_cpus = predict("mlp", "dp-balanced", ["cpu", "cpu"], micro_batch=8, precision="32")
    assert on_cpus["method"] == "closed-form" and len(on_cpus["peaks"]) == 2


def test_cuda_runs_are_predicted_in_the_allocators_blocks() -> None:
    cpu = predict("mlp", "single", ["cpu"], micro_batch=8, precision="32")["peaks"][0]
    cuda = predict("mlp", "single", ["cuda:0"], micro_batch=8, precision="32")["peaks"][0]
    assert cuda > cpu and cuda % 512 == 0


def test_16_mixed_is_predicted_with_bf16_autocast_on_this_cpu() -> None:
    found = predict("mlp", "single", ["cuda:0"], micro_batch=64, precision="16-mixed")
    assert found["method"] == "simulation" and found["precision"] == "16-mixed"
    fp32 = predict("mlp", "single", ["cuda:0"], micro_batch=64, precision="32")
    bf16 = predict("mlp", "single", ["cuda:0"], micro_batch=64, precision="bf16-mixed")
    assert found["peaks"] == bf16["peaks"] != fp32["peaks"]


def test_in_a_process_group_ddp_is_predicted_by_the_closed_form(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    found = predict("mlp", "ddp", ["cpu", "cpu"], micro_batch=8, precision="32")
    assert found["method"] == "closed-form" and "process group" in found["note"]
    assert len(found["peaks"]) == 2 and dist.is_initialized()  # the caller's group is kept


def test_a_prediction_that_fails_is_empty_cells_not_an_exception(monkeypatch) -> None:
    found = predict("mlp", "solo", ["cpu"], micro_batch=8, precision="32")  # no model for it
    assert found["peaks"] is None and found["method"] is None and "solo" in found["error"]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(prediction, "simulate", broken)
    found = predict("mlp", "single", ["cpu"], micro_batch=8, precision="32")
    assert found["peaks"] is None and found["error"] == "RuntimeError: boom"
    cells = tensor_columns([{"peak_tensors": 3 * MiB}], found["peaks"])
    assert cells == {
        "tensors_first": 3.0,
        "predicted_first": None,
        "tensors_others": None,
        "predicted_others": None,
        "tensors_error": None,
    }


def test_columns_take_the_first_device_and_the_fullest_other() -> None:
    memory = [{"peak_tensors": 10 * MiB}, {"peak_tensors": 4 * MiB}, {"peak_tensors": 5 * MiB}]
    cells = tensor_columns(memory, [int(10.1 * MiB), 3 * MiB, 4 * MiB])
    assert (cells["tensors_first"], cells["tensors_others"]) == (10.0, 5.0)
    assert (cells["predicted_first"], cells["predicted_others"]) == (pytest.approx(10.1), 4.0)
    assert cells["tensors_error"] == pytest.approx(-20.0)  # the larger error, with its sign
    one = tensor_columns(memory[:1], [int(10.1 * MiB)])
    assert one["tensors_others"] is None and one["tensors_error"] == pytest.approx(1.0, abs=1e-4)
    unmeasured = tensor_columns([{"peak_tensors": 1}, {"peak_tensors": None}], [1, 1])
    assert unmeasured["tensors_others"] is None and unmeasured["tensors_error"] == 0.0
