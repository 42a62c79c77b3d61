"""The doctor judges GPUKIT_DEVICE against the devices it found, and notices fault injection."""

from __future__ import annotations

import pytest

from gpukit.doctor.features import default_device_check, fault_injection_check
from tests.fakes import cpu_torch, cuda_torch, system


@pytest.mark.parametrize(
    ("value", "torch_info", "words"),
    [
        pytest.param("tpu:9", cpu_torch(), ["is not a device", "TPUs"], id="tpu"),
        pytest.param("??", cpu_torch(), ["is not a device"], id="garbage"),
        pytest.param("cuda:99", cuda_torch(2), ["no GPU 99", "cpu, cuda:0, cuda:1"], id="cuda99"),
        pytest.param("gpu", cpu_torch(), ["no GPU 0", "torch sees 0"], id="gpu-on-cpu"),
        pytest.param("mps", cpu_torch(), ["MPS is not available"], id="mps-missing"),
        pytest.param(
            "cuda:1",
            cuda_torch(1, unreadable=((1, "CUDA error: busy"),)),
            ["CUDA cannot start on GPU 1", "busy"],
            id="cuda-broken",
        ),
    ],
)
def test_a_device_this_machine_lacks_fails(value, torch_info, words) -> None:  # type: ignore[no-untyped-def]
    [check] = default_device_check(system(GPUKIT_DEVICE=value), torch_info)
    assert check.name == "GPUKIT_DEVICE" and check.status == "FAIL"
    assert f"GPUKIT_DEVICE={value!r}" in check.detail
    assert all(word in check.detail for word in words), check.detail
    assert "unset GPUKIT_DEVICE" in check.fix


@pytest.mark.parametrize(
    ("value", "torch_info"),
    [
        ("cpu", cpu_torch()),
        ("auto", cpu_torch()),
        ("/gpu:1", cuda_torch(2)),
        ("cuda", cuda_torch(1)),
    ],
)
def test_a_device_this_machine_has_is_ok(value, torch_info) -> None:  # type: ignore[no-untyped-def]
    [check] = default_device_check(system(GPUKIT_DEVICE=value), torch_info)
    assert check.status == "OK", check


def test_nothing_is_said_when_it_is_unset_or_blank() -> None:
    assert default_device_check(system(), cpu_torch()) == []
    assert default_device_check(system(GPUKIT_DEVICE="  "), cpu_torch()) == []


def test_fault_injection_left_on_is_a_warning() -> None:
    [check] = fault_injection_check(system(GPUKIT_FAULT="sigkill:1:6", GPUKIT_FAULT_OOM_ABOVE="8"))
    assert check.status == "WARN" and "GPUKIT_FAULT=sigkill:1:6" in check.detail
    assert "unset GPUKIT_FAULT and GPUKIT_FAULT_OOM_ABOVE" in check.fix
    assert fault_injection_check(system()) == []
