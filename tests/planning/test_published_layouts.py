"""The layout planner against torchtitan's published Llama 3.1 runs on H100s
(pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 to 6): each row's
memory within 10% and tokens/s per GPU within 25%, with one set of constants for all rows
(gpukit.planning.layout_time). The rows of Tables 2, 4, 5 and 6 ran torch.compile and float8
matrix products (tensorwise, weights gathered in float8) with full activation checkpointing.
"Memory(GiB)" is the allocator's peak reserve, compared with the plan's tensors and reserve,
without the CUDA context. Rows whose memory misses are kept, marked, with the reason
(docs/planning.md)."""

from __future__ import annotations

import pytest

from gpukit.planning.layout_memory import layout_memory
from gpukit.planning.layout_shape import TransformerShape
from gpukit.planning.layout_time import layout_time
from gpukit.planning.layouts import Layout
from gpukit.planning.targets import target

GiB = 2**30
F8 = "tensorwise"


def _llama(dim: int, layers: int, heads: int, hidden: int, seq: int) -> TransformerShape:
    return TransformerShape(dim, layers, heads, 8, hidden, 128256, seq)


def _8b(seq: int) -> TransformerShape:
    return _llama(4096, 32, 32, 14336, seq)


def _70b(seq: int) -> TransformerShape:
    return _llama(8192, 80, 64, 28672, seq)


def _405b(seq: int) -> TransformerShape:
    return _llama(16384, 126, 128, 53248, seq)


def _3d(**sizes: object) -> Layout:
    return Layout(tp=8, pp=8, float8=F8, async_tp=True, **sizes)  # type: ignore[arg-type]


TP_MEMORY = (
    "the plan holds less than the run reserved under tensor parallelism (16% less for 2D, 10% "
    "for AsyncTP); the figures do not say what the rest is: likely the allocator's fragments "
    "around logits-sized tensors and the collectives' buffers, which the plan does not count"
)
# (row, shape, layout, local batch, published tokens/s per GPU, published GiB, memory miss)
ROWS = [
    ("T2 FSDP 8, CP 1", _8b(32768), Layout(dp_shard=8, float8=F8), 1, 3890, 83.9, None),
    ("T2 FSDP 4, CP 2", _8b(65536), Layout(dp_shard=4, cp=2, float8=F8), 1, 2540, 84.2, None),
    ("T2 FSDP 2, CP 4", _8b(131072), Layout(dp_shard=2, cp=4, float8=F8), 1, 1071, 84.0, None),
    ("T2 FSDP 1, CP 8", _8b(262144), Layout(cp=8, float8=F8), 1, 548, 84.5, None),
    ("T4 2D", _70b(8192), Layout(dp_shard=32, tp=8, float8=F8), 16, 829, 71.9, TP_MEMORY),
    (
        "T4 2D + AsyncTP",
        _70b(8192),
        Layout(dp_shard=32, tp=8, float8=F8, async_tp=True),
        16,
        876,
        67.6,
        TP_MEMORY,
    ),
    (
        "T5 1F1B",
        _405b(8192),
        _3d(dp_shard=8),
        32,
        100,
        82.5,
        "the plan holds 1F1B's and interleaved 1F1B's in-flight micro-batches alike; the "
        "published 1F1B run held 10 GiB more than its interleaved one",
    ),
    (
        "T5 Interleaved 1F1B",
        _405b(8192),
        _3d(dp_shard=8, pp_schedule="Interleaved1F1B"),
        32,
        128,
        72.7,
        None,
    ),
    ("T6 FSDP 8, CP 1", _405b(32768), _3d(dp_shard=8), 8, 76, 75.3, None),
    ("T6 FSDP 4, CP 2", _405b(65536), _3d(dp_shard=4, cp=2), 8, 47, 75.9, None),
    ("T6 FSDP 2, CP 4", _405b(131072), _3d(dp_shard=2, cp=4), 8, 31, 77.1, None),
    (
        "T6 FSDP 1, CP 8",
        _405b(262144),
        _3d(cp=8),
        8,
        16,
        84.9,
        "the published peak grows with cp (75.3 to 84.9 GiB) where the plan's stays: the "
        "ring's buffers at cp 8 are not modelled",
    ),
]
IDS = [r[0] for r in ROWS]


@pytest.mark.parametrize(("name", "shape", "layout", "local", "tps", "gib", "miss"), ROWS, ids=IDS)
def test_tokens_per_second_within_25_percent(
    name: str,
    shape: TransformerShape,
    layout: Layout,
    local: int,
    tps: float,
    gib: float,
    miss: str | None,
) -> None:
    planned = layout_time(shape, layout, target("h100"), local_batch=local, checkpointing="full")
    assert planned.tokens_per_s_per_gpu == pytest.approx(tps, rel=0.25)


@pytest.mark.parametrize(
    ("name", "shape", "layout", "local", "tps", "gib", "miss"),
    [
        pytest.param(*r, marks=pytest.mark.xfail(strict=True, reason=r[6])) if r[6] else r
        for r in ROWS
    ],
    ids=IDS,
)
def test_memory_within_10_percent(
    name: str,
    shape: TransformerShape,
    layout: Layout,
    local: int,
    tps: float,
    gib: float,
    miss: str | None,
) -> None:
    parts = layout_memory(shape, layout, local_batch=local, checkpointing="full")
    reserved = sum(v for k, v in parts.items() if k != "cuda_context") / GiB
    assert reserved == pytest.approx(gib, rel=0.10)


@pytest.mark.parametrize(
    ("devices", "float8", "tps"),
    [(8, None, 6667), (8, F8, 8532), (128, None, 6514), (128, F8, 8380)],
)
def test_8b_fsdp_rows_within_25_percent(devices: int, float8: str | None, tps: float) -> None:
    """Tables 1 and 3 with torch.compile, with and without float8: Llama 3.1 8B, local batch 2
    of 8192 tokens, selective (op-level) checkpointing."""
    layout = Layout(dp_shard=devices, float8=float8)
    planned = layout_time(
        _8b(8192), layout, target("h100"), local_batch=2, checkpointing="selective"
    )
    assert planned.tokens_per_s_per_gpu == pytest.approx(tps, rel=0.25)


@pytest.mark.parametrize(("devices", "gib"), [(8, 82.4), (128, 67.0)])
def test_8b_fsdp_memory_within_10_percent(devices: int, gib: float) -> None:
    """Tables 1 and 3, row "FSDP" (without torch.compile, whose memory the plan does not
    model: the compiled rows held 5 GiB less)."""
    parts = layout_memory(
        _8b(8192), Layout(dp_shard=devices), local_batch=2, checkpointing="selective"
    )
    reserved = sum(v for k, v in parts.items() if k != "cuda_context") / GiB
    assert reserved == pytest.approx(gib, rel=0.10)
