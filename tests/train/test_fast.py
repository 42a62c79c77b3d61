"""What gpukit train chooses for speed on a GPU (gpukit.train.fast): compile decided from the
devices, the run's length and the model's size; TF32 switched on for the run and back after;
fused AdamW on CUDA only, so a CPU run stays a plain loop's, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.optim import optimizer as optimizer_module

from gpukit.train import fast

GPU_RUN: dict[str, Any] = {"cuda": True, "strategy": "auto", "devices": 1, "parameters": 10_000}


@pytest.mark.parametrize(
    ("asked", "run", "setting", "said"),
    [
        ("auto", {**GPU_RUN, "cuda": False}, False, "this run trains on a CPU"),
        ("auto", {**GPU_RUN, "steps": 499}, False, "499 steps are too few"),
        ("auto", {**GPU_RUN, "steps": 500}, "reduce-overhead", "replayed as CUDA graphs"),
        ("auto", {**GPU_RUN, "steps": 500, "devices": 2}, True, "500 steps repay compiling"),
        ("auto", {**GPU_RUN, "steps": 500, "strategy": "ddp"}, True, "repay"),
        ("auto", {**GPU_RUN, "steps": 500, "parameters": 124_000_000}, True, "repay"),
        ("auto", {**GPU_RUN, "steps": 500, "fixed_shapes": False}, True, "repay"),
        ("auto", {**GPU_RUN, "steps": 5000, "strategy": "dp"}, False, "copies the model"),
        ("off", {**GPU_RUN, "steps": 5000}, False, "--compile off"),
        ("on", {**GPU_RUN, "cuda": False, "steps": 1}, True, "--compile on"),
        ("max-autotune", {**GPU_RUN, "steps": 1}, "max-autotune", "--compile max-autotune"),
    ],
)
def test_compile_is_decided_and_said(
    asked: str, run: dict[str, Any], setting: bool | str, said: str
) -> None:
    chosen = fast.compile_choice(asked, **{"steps": 0, **run})
    assert chosen.setting == setting and said in chosen.why


def test_the_largest_model_replayed_as_graphs_is_the_declared_bound() -> None:
    bound = fast.GRAPHS_UP_TO_PARAMETERS
    at = fast.compile_choice("auto", **{**GPU_RUN, "steps": 500, "parameters": bound})
    over = fast.compile_choice("auto", **{**GPU_RUN, "steps": 500, "parameters": bound + 1})
    assert (at.setting, over.setting) == ("reduce-overhead", True)


def test_tf32_is_on_for_a_cuda_run_and_put_back_after() -> None:
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        with fast.tf32(torch.device("cuda", 0)) as on:
            assert on and torch.get_float32_matmul_precision() == "high"
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        assert not torch.backends.cudnn.allow_tf32
        with fast.tf32(torch.device("cpu")) as on:  # a CPU run: nothing touched
            assert not on and torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def test_tf32_is_put_back_when_the_run_fails() -> None:
    before = torch.get_float32_matmul_precision()
    with pytest.raises(RuntimeError, match="boom"), fast.tf32(torch.device("cuda", 0)):
        raise RuntimeError("boom")
    assert torch.get_float32_matmul_precision() == before


def test_adamw_is_fused_on_cuda_only() -> None:
    assert fast.fused_adamw(torch.device("cuda", 0))
    assert not fast.fused_adamw(torch.device("cpu"))


def test_a_meta_model_gets_fused_adamw_only_where_torch_checks_devices_at_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with torch.device("meta"):
        meta = list(torch.nn.Linear(2, 2).parameters())
    cuda = torch.device("cuda", 0)
    assert fast.fused_adamw(cuda, meta)  # this torch checks at the first step
    # An older torch checked the devices when the optimizer was made: meta would fail there.
    monkeypatch.delattr(optimizer_module, "_device_dtype_check_for_fused")
    assert not fast.fused_adamw(cuda, meta)
    assert fast.fused_adamw(cuda, list(torch.nn.Linear(2, 2).parameters()))


def test_a_cpu_run_trains_exactly_as_the_plain_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpukit train on a CPU builds AdamW as a plain program does (no fused keyword)."""
    import gpukit as gk
    from gpukit.train.loop import fit
    from gpukit.train.options import TrainConfig

    made: list[dict[str, Any]] = []
    adamw = torch.optim.AdamW

    def recording(params: Any, **kwargs: Any) -> torch.optim.AdamW:
        made.append(kwargs)
        return adamw(params, **kwargs)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    config = TrainConfig(workload="mlp", max_steps=1, progress=False, sample=False)
    metrics = gk.Runtime(devices="cpu").launch(fit, config)
    assert made == [{"lr": made[0]["lr"]}]
    assert metrics["fast"]["tf32"] is False and metrics["fast"]["fused_adamw"] is False
