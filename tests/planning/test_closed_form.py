"""The closed form against peaks measured by counting live tensors over real training steps."""

from __future__ import annotations

import pytest
import torch

import gpukit as gk
from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.errors import ConfigError
from gpukit.planning.closed_form import ModelFacts, closed_form, model_facts
from gpukit.workloads.base import load_workload

# Peak bytes of live tensors (LiveTensors, cpu) over 3 AdamW train steps through gk.Runtime,
# precision "32", micro-batch = the workload's batch_size // N, measured with the planner's
# harness: `python sim2.py real single 1 <w>` and, for ddp/fsdp,
# `python -m torch.distributed.run --nproc-per-node N sim2.py real <strategy> N <w>` (gloo),
# torch 2.13 CPU. Rank 0's peak (the ranks agreed).
MEASURED = {
    ("mlp", "single", 1): 153956,
    ("mlp", "ddp", 1): 180084,
    ("mlp", "ddp", 2): 168048,
    ("mlp", "fsdp", 1): 180088,
    ("mlp", "fsdp", 2): 120412,
    ("cnn", "single", 1): 75253664,
    ("cnn", "ddp", 1): 75954696,
    ("cnn", "ddp", 2): 39385352,
    ("cnn", "fsdp", 1): 75554060,
    ("cnn", "fsdp", 2): 38226500,
    ("gpt", "single", 1): 21132412,
    ("gpt", "ddp", 1): 21568124,
    ("gpt", "ddp", 2): 11655804,
    ("gpt", "fsdp", 1): 21191296,
    ("gpt", "fsdp", 2): 10956420,
}

_FACTS: dict[str, tuple[ModelFacts, int]] = {}


def facts_of(name: str) -> tuple[ModelFacts, int]:
    if name not in _FACTS:
        w = load_workload(name, seed=0)
        _FACTS[name] = (model_facts(w.model, w.dataset[0], loss=w.loss), w.batch_size)
    return _FACTS[name]


@pytest.mark.parametrize(("workload", "strategy", "devices"), sorted(MEASURED))
def test_within_15_percent_of_measured(workload: str, strategy: str, devices: int) -> None:
    facts, batch = facts_of(workload)
    peaks = closed_form(facts, strategy=strategy, devices=devices, micro_batch=batch // devices)
    assert len(peaks) == devices
    measured = MEASURED[(workload, strategy, devices)]
    assert abs(peaks[0].peak_bytes / measured - 1) < 0.15


def test_measured_live_single_mlp() -> None:
    w = load_workload("mlp", seed=0)
    items = [w.dataset[i] for i in range(w.batch_size)]
    model = w.model
    live = LiveTensors()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with live:
        live.watch(model, [opt])
        rt = gk.Runtime(devices="cpu", precision="32")
        m, o = rt.setup(model, opt)
        live.watch(rt.unwrap(m), [o])
        live.file_made("communication")
        crit = rt.setup_criterion(w.loss)
        for _ in range(3):
            batch = torch.utils.data.default_collate(items)
            rt.train_step(o, batch, lambda b: crit(m(b[0]), b[1]))
            del batch
    facts, _ = facts_of("mlp")
    predicted = closed_form(facts, strategy="single", devices=1, micro_batch=w.batch_size)[0]
    assert abs(predicted.peak_bytes / live.peak["cpu"] - 1) < 0.15
    assert live.peak["cpu"] == MEASURED[("mlp", "single", 1)]


def test_model_facts_counts_states_and_activations() -> None:
    facts, _ = facts_of("gpt")
    w = load_workload("gpt", seed=0)
    unique = {id(p): p for p in w.model.parameters()}.values()  # the tied head counted once
    assert facts.trainable_bytes == sum(p.numel() * 4 for p in unique)
    assert facts.activation_bytes_per_sample > 0 and facts.output_bytes_per_sample > 0
    full = model_facts(w.model, w.dataset[0], loss=w.loss, activation_checkpointing="full")
    selective = model_facts(
        w.model, w.dataset[0], loss=w.loss, activation_checkpointing="selective"
    )
    assert full.activations(32) < selective.activations(32) < facts.activations(32)
    bf16 = model_facts(w.model, w.dataset[0], loss=w.loss, precision="bf16-mixed")
    assert bf16.activations(32) < facts.activations(32)
    assert all(p.device.type == "cpu" and not p.is_meta for p in w.model.parameters())


def test_dp_first_device_holds_more_and_balanced_less() -> None:
    facts, batch = facts_of("gpt")
    dp = closed_form(facts, strategy="dp", devices=4, micro_batch=batch // 4)
    balanced = closed_form(facts, strategy="dp-balanced", devices=4, micro_batch=batch // 4)
    assert dp[0].peak_bytes > max(p.peak_bytes for p in dp[1:])
    assert balanced[0].peak_bytes < dp[0].peak_bytes


@pytest.mark.parametrize("workload", ["mlp", "cnn", "gpt"])
def test_fsdp_shrinks_with_devices(workload: str) -> None:
    facts, _ = facts_of(workload)
    peaks = [
        closed_form(facts, strategy="fsdp", devices=n, micro_batch=4)[0].peak_bytes
        for n in (1, 2, 8, 64)
    ]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_granularity_rounds_up_and_categories_are_named() -> None:
    facts, _ = facts_of("mlp")
    exact = closed_form(facts, strategy="single", devices=1, micro_batch=8)[0]
    rounded = closed_form(facts, strategy="single", devices=1, micro_batch=8, granularity=512)[0]
    assert rounded.peak_bytes > exact.peak_bytes
    assert rounded.breakdown["parameters"] % 512 == 0
    assert exact.breakdown["cuda_context"] == exact.breakdown["allocator_reserve"] == 0


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"strategy": "zero3"}, "fsdp"),
        ({"devices": 0}, ">= 1"),
        ({"micro_batch": 0}, ">= 1"),
        ({"optimizer": "lion"}, "sgd-momentum"),
    ],
)
def test_bad_inputs(kwargs: dict[str, object], allowed: str) -> None:
    facts, _ = facts_of("mlp")
    settings: dict[str, object] = {"strategy": "ddp", "devices": 2, "micro_batch": 4, **kwargs}
    with pytest.raises(ConfigError, match=allowed):
        closed_form(facts, **settings)  # type: ignore[arg-type]


def test_data_dependent_forward_is_a_config_error() -> None:
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)[: int(x.sum().item() > 0) + 1]

    with pytest.raises(ConfigError, match="activations"):
        model_facts(Branchy(), (torch.ones(4), torch.tensor(0)))
