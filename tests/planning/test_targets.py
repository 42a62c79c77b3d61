"""Targets: known GPUs by any spelling, this machine through the hw seam, sizes."""

from __future__ import annotations

import pytest

from gpukit.errors import ConfigError
from gpukit.planning.targets import (
    ALLOCATOR_RESERVE_FRACTION,
    CUDA_CONTEXT_BYTES,
    known_names,
    parse_bytes,
    target,
    with_memory,
)

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize(
    ("spec", "name", "mib"),
    [
        ("h100", "H100", 81559),
        ("NVIDIA H100 80GB HBM3", "H100", 81559),
        ("h200", "H200", 143771),
        ("a100-40gb", "A100 40GB", 40960),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 40960),
        ("A100", "A100 80GB", 81920),
        ("l40s", "L40S", 46068),
        ("L4", "L4", 23034),
        ("a10g", "A10G", 23028),
        ("v100 16gb", "V100 16GB", 16160),
        ("rtx 4090", "RTX 4090", 24564),
        ("Tesla T4", "T4", 15360),
    ],
)
def test_gpu_names_in_any_spelling(spec: str, name: str, mib: int) -> None:
    t = target(spec)
    assert (t.name, t.kind, t.memory_bytes) == (name, "cuda", mib * MiB)
    assert t.cuda_context_bytes == CUDA_CONTEXT_BYTES
    assert t.allocator_reserve_fraction == ALLOCATOR_RESERVE_FRACTION


def test_peaks_and_links_come_from_the_tables() -> None:
    h100, a100, l4 = target("h100"), target("a100"), target("l4")
    assert h100.peak_flops["bf16"] == 989.4e12 and h100.link_bytes_per_s == 450e9
    assert a100.peak_flops["tf32"] == 156e12 and a100.link_bytes_per_s == 300e9
    assert l4.link_bytes_per_s == 25e9
    assert "bf16" not in target("t4").peak_flops
    assert target("a100-pcie-40gb").link_bytes_per_s < a100.link_bytes_per_s
    assert target("h100 pcie").peak_flops["bf16"] < h100.peak_flops["bf16"]


def test_cpu_target(cpu_only: None) -> None:
    for t in (target("cpu"), target("CPU"), target(None)):
        assert t.kind == "cpu" and t.cuda_context_bytes == 0
        assert t.allocator_reserve_fraction == 0.0
        assert t.peak_flops["fp32"] > 0
        assert t.memory_bytes is None or t.memory_bytes > 0


def test_this_machine_reads_its_gpu(fake_gpus) -> None:  # type: ignore[no-untyped-def]
    fake_gpus(2, name="NVIDIA A100-SXM4-40GB")
    t = target(None)
    assert t.kind == "cuda" and t.name == "NVIDIA A100-SXM4-40GB"
    assert t.memory_bytes == 80 * GiB  # what the device reports, not the table
    assert t.peak_flops["bf16"] == 312e12 and t.link_bytes_per_s == 300e9


def test_this_machine_with_an_unknown_gpu(fake_gpus) -> None:  # type: ignore[no-untyped-def]
    fake_gpus(1, name="NVIDIA GeForce GTX 1080")
    t = target(None)
    assert t.memory_bytes == 80 * GiB and t.peak_flops == {}


@pytest.mark.parametrize("spec", ["tpu", "", "   ", 3])
def test_unknown_targets_list_the_known_ones(spec: object) -> None:
    with pytest.raises(ConfigError, match=r"h100|H100"):
        target(spec)  # type: ignore[arg-type]


def test_known_names_cover_every_variant() -> None:
    names = known_names()
    assert {"H200", "H100", "A100 80GB", "A100 40GB", "V100 32GB", "V100 16GB", "T4"} <= set(names)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GiB),
        ("24GB", 24 * 10**9),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("1.5G", int(1.5 * GiB)),
        ("1024", 1024),
        ("2e9", 2 * 10**9),
    ],
)
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "0", "-1GB", "12 parsecs", "0.1", None, 5])
def test_parse_bytes_rejects_garbage(text: object) -> None:
    with pytest.raises(ConfigError, match="80GiB"):
        parse_bytes(text)  # type: ignore[arg-type]


def test_with_memory() -> None:
    t = with_memory(target("h100"), 40 * GiB)
    assert t.memory_bytes == 40 * GiB and t.name == "H100"
    for bad in (0, -5, 1.5, True, "40GB"):
        with pytest.raises(ConfigError, match="parse_bytes"):
            with_memory(t, bad)  # type: ignore[arg-type]
