"""The GPUs' dense peaks per dtype: each entry reached by its own name (longer names before
their prefixes), the published figures of the common ones, and MFU's older table unchanged."""

from __future__ import annotations

import pytest
import torch

from gpukit.errors import ConfigError
from gpukit.workloads.flops import DENSE_PEAK_FLOPS, PEAK_DTYPES, PEAK_FLOPS, mfu, peak_flops


@pytest.mark.parametrize("key", list(DENSE_PEAK_FLOPS))
def test_every_entry_is_reached_by_its_own_name(key: str) -> None:
    for dtype, peak in DENSE_PEAK_FLOPS[key].items():
        assert peak_flops(f"NVIDIA {key}", dtype) == peak


@pytest.mark.parametrize(
    ("name", "fp32", "tf32", "bf16"),
    [
        ("NVIDIA H100 80GB HBM3", 67e12, 494.7e12, 989.4e12),
        ("NVIDIA H200", 67e12, 494.7e12, 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 19.5e12, 156e12, 312e12),
        ("NVIDIA A100-PCIE-40GB", 19.5e12, 156e12, 312e12),
        ("NVIDIA L4", 30.3e12, 60e12, 121e12),
        ("NVIDIA L40S", 91.6e12, 183e12, 362e12),
        ("NVIDIA A10G", 31.2e12, 62.5e12, 125e12),
        ("Tesla V100-SXM2-16GB", 15.7e12, None, None),
        ("Tesla T4", 8.1e12, None, None),
    ],
)
def test_published_dense_figures(
    name: str, fp32: float, tf32: float | None, bf16: float | None
) -> None:
    assert peak_flops(name, "fp32") == fp32 and peak_flops(name, torch.float32) == fp32
    assert peak_flops(name, "tf32") == tf32
    assert peak_flops(name, "bf16") == bf16 == peak_flops(name, torch.bfloat16)


def test_tensor_cores_beat_the_cuda_cores_and_fp16_matches_bf16_where_both_exist() -> None:
    for key, peaks in DENSE_PEAK_FLOPS.items():
        assert set(peaks) <= set(PEAK_DTYPES) and "fp32" in peaks and "fp16" in peaks, key
        assert peaks.get("tf32", peaks["fp32"]) >= peaks["fp32"], key
        assert peaks["fp16"] > peaks["fp32"], key
        assert peaks.get("bf16", peaks["fp16"]) == peaks["fp16"], key


def test_cpus_and_unknown_gpus_have_no_peak() -> None:
    assert peak_flops("AMD EPYC 7B13", "fp32") is None
    assert peak_flops("NVIDIA GeForce GTX 1080", "fp16") is None


def test_a_dtype_without_a_peak_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"dtype 'int8': peaks are known for fp32, tf32"):
        peak_flops("NVIDIA H100 80GB HBM3", "int8")
    with pytest.raises(ConfigError, match=r"dtype 'torch.float64'"):
        peak_flops("NVIDIA H100 80GB HBM3", torch.float64)


def test_mfu_keeps_its_own_table() -> None:
    assert PEAK_FLOPS["H100"] == 989e12
    assert mfu(989e12, "NVIDIA H100 80GB HBM3", gpus=2) == 0.5
