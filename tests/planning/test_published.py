"""The planner's peak memory against published and measured peaks of large models, within 10%.

Published: torchtitan's Llama 3.1 8B runs on H100s with 96 GB (pytorch/torchtitan,
benchmarks/llama3_h100_202412_torchtitan.md). Their "Memory(GiB)" is torchtitan's
``max_reserved_gib``: ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` in GiB, what the
caching allocator held at most, without the CUDA context; so it is compared with the plan's
tensors plus its allocator reserve.

Measured: ``llama3_2_1b`` on one H100 80GB (benchmarks/results/2026-11-26-h100-large and
2026-11-26-h100-selective): ``torch.cuda.max_memory_allocated`` against the plan's tensors, and
the reserve at the end against tensors plus reserve.
"""

from __future__ import annotations

import functools

import pytest

import gpukit as gk
from gpukit.workloads.llama import llama3_8b

GiB = 2**30
ONE_B = "gpukit.workloads.llama:llama3_2_1b"


def _reserved(report: gk.PlanReport) -> float:
    """The plan's tensors and allocator reserve on its first device, in GiB."""
    parts = report.plans[0].per_device[0].breakdown
    return sum(v for k, v in parts.items() if k != "cuda_context") / GiB


def _torchtitan_8b(devices: int, seq_len: int, local_batch: int, checkpointing: str) -> float:
    report = gk.plan(
        functools.partial(llama3_8b, seq_len=seq_len),
        devices=devices,
        batch=local_batch * devices,
        strategies=["fsdp"],
        target="h100",
        memory=96 * GiB,
        fsdp_mixed="bf16",
        activation_checkpointing=checkpointing,
        method="closed-form",
    )
    assert report.plans[0].micro_batch == local_batch
    return _reserved(report)


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "published"), [(8, 82.4), (128, 67.0)])
def test_torchtitan_8b_selective_op_checkpointing(devices: int, published: float) -> None:
    """Tables 1 and 3, row "FSDP" (no torch.compile): FSDP2 with bf16 parameters and float32
    reduction, op-level selective checkpointing (every second matrix product kept), local
    batch 2 of 8192 tokens, AdamW: 82.4 GiB on 8 GPUs, 67.0 GiB on 128."""
    planned = _torchtitan_8b(devices, 8192, 2, "selective")
    assert planned == pytest.approx(published, rel=0.10)


@pytest.mark.slow
def test_torchtitan_8b_full_checkpointing_long_sequence() -> None:
    """Table 2, row "FSDP 8, CP 1": 8 GPUs, local batch 1 of 32768 tokens, full
    checkpointing, 83.9 GiB. That run also compiled the blocks and computed their matrix
    products in float8, which the plan does not model; with full checkpointing they change
    only the one block recomputed at a time."""
    planned = _torchtitan_8b(8, 32768, 1, "full")
    assert planned == pytest.approx(83.9, rel=0.10)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "tensors", "reserved"),
    [
        ({"strategies": ["fsdp"], "fsdp_mixed": "bf16", "precision": "32"}, 38.2, 43.6),
        (
            {
                "strategies": ["fsdp"],
                "fsdp_mixed": "bf16",
                "precision": "32",
                "activation_checkpointing": "selective",
            },
            30.3,
            36.1,
        ),
        (
            {
                "strategies": ["fsdp"],
                "fsdp_mixed": "bf16",
                "precision": "32",
                "activation_checkpointing": "full",
            },
            26.7,
            32.7,
        ),
        ({"strategies": ["single"], "precision": "bf16-mixed"}, 42.5, 43.2),
    ],
    ids=["fsdp-bf16", "fsdp-bf16-selective", "fsdp-bf16-full", "single-bf16-mixed"],
)
def test_h100_measurements_of_a_1b_llama(
    options: dict[str, object], tensors: float, reserved: float
) -> None:
    report = gk.plan(ONE_B, devices=1, batch=4, target="h100", **options)  # type: ignore[arg-type]
    device = report.plans[0].per_device[0]
    assert device.tensor_bytes / GiB == pytest.approx(tensors, rel=0.10)
    assert _reserved(report) == pytest.approx(reserved, rel=0.10)
