"""Step time under FSDP2 mixed precision: the matrix products at bf16's rate whatever the
precision, all-gathers of bf16 parameters, reduce-scatters of float32 gradients."""

from __future__ import annotations

from typing import Any

import pytest

from gpukit.errors import ConfigError
from gpukit.planning.planner import plan
from gpukit.planning.targets import Target, target
from gpukit.planning.timing import step_time
from gpukit.workloads.llama import LlamaShape, llama

# Round numbers: 1e9 bytes/s links with 1 us hops; bf16 16x fp32's peak.
ROUND = Target("round", "cuda", 10**10, {"fp32": 1e12, "bf16": 16e12}, 1e9, 1e-6, 0, 0.0)
# 1e9 bytes of float32 parameters in 10 blocks; compute too short to hide anything.
MODEL = {"flops_per_sample": 1.0, "trainable_bytes": 10**9, "largest_group_bytes": 10**8}


def run(**kw: Any) -> Any:
    args: dict[str, Any] = {"target": ROUND, "strategy": "fsdp", "devices": 4}
    args.update({"micro_batch": 1, "accumulate": 2, "precision": "32", **MODEL, **kw})
    return step_time(**args)[0]


def test_compute_runs_at_bf16_rate() -> None:
    h100 = target("h100")
    args: dict[str, Any] = {"target": h100, "strategy": "fsdp", "devices": 8, "micro_batch": 2}
    args.update(accumulate=1, flops_per_sample=1e15, trainable_bytes=10**9)
    args.update(largest_group_bytes=10**8)
    fp32 = step_time(**args, precision="32")[0]
    mixed, _, mfu = step_time(**args, precision="32", mixed="bf16")
    bf16 = step_time(**args, precision="bf16-mixed")[0]
    assert mixed.compute_s == pytest.approx(bf16.compute_s)
    ratio = h100.peak_flops["bf16"] / h100.peak_flops["fp32"]
    assert fp32.compute_s == pytest.approx(ratio * mixed.compute_s)
    assert mfu is not None and mfu < 1


def test_collectives_move_bf16_gathers_and_fp32_reductions_by_hand() -> None:
    # A ring all-gather (or reduce-scatter) over 4: 3/4 of the bytes, 3 hops per block.
    def ring(nbytes: float) -> float:
        return 10 * (0.75 * nbytes / 10 / 1e9 + 3e-6)

    plain = run().communication_s
    mixed = run(mixed="bf16").communication_s
    compute = run(mixed="bf16").compute_s  # what little it hides
    assert plain == pytest.approx(2 * 3 * ring(1e9), rel=1e-6)
    # per micro-step: forward gather (bf16), backward gather (bf16) + reduce-scatter (fp32)
    assert mixed == pytest.approx(2 * (2 * ring(5e8) + ring(1e9)), rel=1e-6)
    assert compute < 1e-9
    # parameters already in bf16: gathered as they are, reduced in float32 all the same
    half = run(mixed="bf16", trainable_bytes=5 * 10**8, trainable_numel=25 * 10**7)
    assert half.communication_s == pytest.approx(mixed, rel=1e-2)


def test_unknown_mixed_is_refused() -> None:
    with pytest.raises(ConfigError, match="mixed='fp8'"):
        run(mixed="fp8")


def test_planner_plans_fsdp_mixed_at_bf16_rate() -> None:
    shape = LlamaShape(dim=64, layers=2, heads=4, kv_heads=2, hidden=128, vocab=256)

    def workload() -> Any:
        return llama(shape, seq_len=16, batch_size=4)

    kw: dict[str, Any] = {"devices": 2, "strategies": ["fsdp"], "target": "h100"}
    mixed = plan(workload, precision="32", fsdp_mixed="bf16", **kw).plans[0]
    fp32 = plan(workload, precision="32", **kw).plans[0]
    bf16 = plan(workload, precision="bf16-mixed", **kw).plans[0]
    assert mixed.step_time is not None and bf16.step_time is not None
    assert fp32.step_time is not None
    assert mixed.step_time.compute_s == pytest.approx(bf16.step_time.compute_s)
    assert mixed.step_time.compute_s < fp32.step_time.compute_s / 10
