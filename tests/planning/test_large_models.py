"""Planning a model that does not fit this machine: a Llama 3 8B shape on the meta device,
planned for 8 and 128 H100s by the closed form without materialising it."""

from __future__ import annotations

import functools
import json
import tracemalloc

import pytest
import torch

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError
from gpukit.planning.closed_form import closed_form
from gpukit.planning.facts import model_facts
from gpukit.planning.report import PlanReport
from gpukit.planning.result import DevicePeak, Plan
from gpukit.planning.targets import target
from gpukit.workloads.base import load_workload
from gpukit.workloads.llama import LlamaShape, llama, llama3_8b

GiB = 2**30
SPEC = "gpukit.workloads.llama:llama3_8b"


@pytest.fixture(scope="module")
def planned() -> tuple[gk.PlanReport, int]:
    tracemalloc.start()
    try:
        report = gk.plan(
            functools.partial(llama3_8b, seq_len=2048),
            devices=[8, 128],
            strategies=["ddp", "fsdp"],
            target="h100",
            fsdp_mixed="bf16",
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return report, peak


def test_8b_meta_model_is_planned_on_8_and_128_without_allocating(
    planned: tuple[gk.PlanReport, int],
) -> None:
    report, traced = planned
    assert {(p.strategy, p.devices) for p in report.plans} == {
        (s, n) for s in ("ddp", "fsdp") for n in (8, 128)
    }
    # 8e9 float32 parameters are 32 GB: the plan held a few MB of Python objects.
    assert traced < 256 * 2**20
    for p in report.plans:
        assert p.method == "closed-form" and p.peak_bytes > 0
        parts = p.per_device[0].breakdown
        assert parts["parameters"] > 0 and parts["optimizer_state"] > 0
        assert parts["allocator_reserve"] > 0 and parts["activations"] > 0
    by = {(p.strategy, p.devices): p for p in report.plans}
    # ddp replicates 32 GB of weights, as much in gradients and buckets, 64 GB of AdamW state.
    assert by["ddp", 8].per_device[0].breakdown["optimizer_state"] > 64e9
    assert all(
        by["ddp", n].fits is False and by["ddp", n].largest_micro_batch == 0 for n in (8, 128)
    )
    # fsdp shards them: 1/8 and 1/128 of each.
    assert by["fsdp", 8].fits and by["fsdp", 128].fits
    assert by["fsdp", 128].peak_bytes < by["fsdp", 8].peak_bytes
    assert report.best is not None and report.best.strategy == "fsdp"
    assert any("meta device" in n for p in report.plans for n in p.notes)
    assert any("mixed precision bf16" in n for n in by["fsdp", 8].notes)


def test_the_8b_workload_is_llama_3_8b_on_meta() -> None:
    w = load_workload(SPEC, meta=True)
    assert sum(p.numel() for p in w.model.parameters()) == 8_030_261_248
    assert all(p.is_meta for p in w.model.parameters())
    with pytest.raises(ConfigError, match="meta device"):
        load_workload(SPEC)  # training refuses it: nothing to train on


def test_bf16_mixed_lowers_the_estimate_by_the_expected_amount() -> None:
    w = llama(LlamaShape(layers=2), seq_len=256)
    ex, loss = w.dataset[0], w.loss
    fp32 = model_facts(w.model, ex, precision="bf16-mixed", loss=loss)
    bf16 = model_facts(w.model, ex, precision="bf16-mixed", loss=loss, param_dtype=torch.bfloat16)
    # Autocast's bf16 copies of the weights, saved by each matrix product, are not made when
    # the parameters are bf16 already: 2 bytes per weight of every Linear.
    weights = sum(m.weight.numel() for m in w.model.modules() if isinstance(m, torch.nn.Linear))
    assert fp32.activation_bytes_fixed - bf16.activation_bytes_fixed == 2 * weights
    # Same facts: only the gathered weights and a group's unsharded gradients halve.
    kw = {"strategy": "fsdp", "devices": 8, "micro_batch": 1, "precision": "bf16-mixed"}
    full = closed_form(fp32, **kw)[0].breakdown  # type: ignore[arg-type]
    half = closed_form(fp32, mixed="bf16", **kw)[0].breakdown  # type: ignore[arg-type]
    gathered = fp32.root_group_bytes + 2 * fp32.largest_block_bytes
    largest = fp32.largest_group_bytes
    expected = gathered - gathered // 2 + largest - largest // 2
    assert full["communication"] - half["communication"] == expected
    assert {k: v for k, v in full.items() if k != "communication"} == {
        k: v for k, v in half.items() if k != "communication"
    }


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"fsdp_mixed": "fp8"}, "choose among bf16"),
        ({"fsdp_mixed": "bf16", "strategies": ["ddp"]}, "applies to fsdp"),
    ],
)
def test_bad_mixed_refused(kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        gk.plan("mlp", devices=2, target="cpu", method="closed-form", **kwargs)  # type: ignore[arg-type]


def test_closed_form_refuses_mixed_for_a_strategy_that_gathers_nothing() -> None:
    facts = model_facts(torch.nn.Linear(4, 2), (torch.ones(4), torch.tensor(0)))
    with pytest.raises(ConfigError, match="gathers no weights"):
        closed_form(facts, strategy="ddp", devices=2, micro_batch=1, mixed="bf16")
    with pytest.raises(ConfigError, match="mixed='fp16'"):
        closed_form(facts, strategy="fsdp", devices=2, micro_batch=1, mixed="fp16")


def _fits(strategy: str, per_s: float) -> Plan:
    gib = 2**30
    peak = (DevicePeak("cuda:0", {"parameters": gib}),) * 8
    return Plan(
        strategy, 8, 2, 1, "bf16-mixed", "off", peak, capacity_bytes=2 * gib, samples_per_s=per_s
    )


def test_the_simplest_strategy_that_fits_is_recommended_unless_clearly_slower() -> None:
    goal = target("h100")
    close = PlanReport("w", goal, (_fits("ddp", 100.0), _fits("fsdp", 105.0)))
    assert close.best is not None and close.best.strategy == "ddp"
    assert "fsdp would be 5% faster" in close.recommendation
    far = PlanReport("w", goal, (_fits("ddp", 100.0), _fits("fsdp", 130.0)))
    assert far.best is not None and far.best.strategy == "fsdp"
    assert "30% faster than ddp, which fits too" in far.recommendation


def test_cli_fsdp_mixed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--workload",
        "mlp",
        "--devices",
        "2",
        "--target",
        "h100",
        "--method",
        "closed-form",
        "--strategies",
        "ddp,fsdp",
        "--json",
    ]
    assert main([*argv, "--fsdp-mixed", "bf16"]) == 0
    mixed = {p["strategy"]: p for p in json.loads(capsys.readouterr().out)["plans"]}
    assert any("mixed precision bf16" in n for n in mixed["fsdp"]["notes"])
    assert not any("mixed" in n for n in mixed["ddp"]["notes"])
    with pytest.raises(SystemExit):
        main([*argv, "--fsdp-mixed", "fp8"])  # argparse's choices
