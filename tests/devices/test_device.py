"""Resolving specs against a machine: real CPU here, pretend GPUs through ``fake_gpus``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gpukit as gk
from gpukit.devices.device import Device


def test_cpu_only_machine_lists_just_the_cpu(cpu_only) -> None:
    found = gk.devices()
    assert [str(d) for d in found] == ["cpu"]
    assert found[0].name and found[0].total_memory


@pytest.mark.parametrize(
    "spec",
    [
        "cpu",
        "CPU",
        "cpu:0",
        "/cpu:0",
        "/device:CPU:0",
        None,
        "auto",
        gk.cpu(),
        torch.device("cpu"),
        "/job:localhost/replica:0/task:0/device:CPU:0",
    ],
    ids=repr,
)
def test_cpu_spellings_resolve_on_cpu_machine(cpu_only, spec: object) -> None:
    dev = gk.device(spec)
    assert dev == Device("cpu") and str(dev) == "cpu" and dev.torch == torch.device("cpu")


@pytest.mark.parametrize(
    "spec", ["gpu", "gpu:0", "/gpu:0", "cuda:0", 0, torch.device("cuda")], ids=repr
)
def test_gpu_on_cpu_only_build_names_the_build_and_the_fix(cpu_only, spec: object) -> None:
    with pytest.raises(gk.DeviceError) as err:
        gk.device(spec)
    text = str(err.value)
    assert "CPU-only" in text and "this machine has cpu" in text and "install a CUDA build" in text


def test_malformed_spec_lists_machine_devices_and_spellings(cpu_only) -> None:
    with pytest.raises(
        gk.DeviceError,
        match=r"invalid device 'cuda:x'.*this machine has cpu.*"
        r"write it as 'cuda:0'",
    ):
        gk.device("cuda:x")


def test_device_error_is_also_a_value_error() -> None:
    with pytest.raises(ValueError):
        gk.device("tpu")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("gpu:1", "cuda:1"),
        ("GPU:1", "cuda:1"),
        ("/gpu:1", "cuda:1"),
        ("/device:GPU:1", "cuda:1"),
        ("/job:localhost/replica:0/task:0/device:GPU:1", "cuda:1"),
        ("cuda:1", "cuda:1"),
        (1, "cuda:1"),
        ("gpu", "cuda:0"),
        ("cuda", "cuda:0"),
        (torch.device("cuda", 1), "cuda:1"),
        (None, "cuda:0"),
        ("auto", "cuda:0"),
        ("cpu", "cpu"),
    ],
    ids=repr,
)
def test_gpu_spellings_resolve_on_two_gpu_machine(fake_gpus, spec: object, expected: str) -> None:
    fake_gpus(2)
    dev = gk.device(spec)
    assert str(dev) == expected
    if dev.type == "cuda":
        assert dev.name == "NVIDIA H100 80GB HBM3" and dev.compute_capability == (9, 0)
        assert repr(dev) == f"Device({expected}, 'NVIDIA H100 80GB HBM3', 80 GiB)"


def test_devices_lists_cpu_then_gpus(fake_gpus) -> None:
    fake_gpus(2)
    assert [str(d) for d in gk.devices()] == ["cpu", "cuda:0", "cuda:1"]


def test_mxnet_style_helpers(fake_gpus) -> None:
    fake_gpus(2)
    assert str(gk.gpu()) == "cuda:0" and str(gk.gpu(1)) == "cuda:1" and str(gk.cpu()) == "cpu"
    with pytest.raises(gk.DeviceError, match="there is no GPU 2"):
        gk.gpu(2)
    with pytest.raises(gk.DeviceError, match="must be a GPU index"):
        gk.gpu("1")  # type: ignore[arg-type]
    with pytest.raises(gk.DeviceError, match="negative"):
        gk.gpu(-1)


def test_out_of_range_index_lists_devices_and_valid_range(fake_gpus) -> None:
    fake_gpus(2)
    with pytest.raises(gk.DeviceError) as err:
        gk.device("gpu:3")
    assert str(err.value) == (
        "unknown device 'gpu:3': there is no GPU 3; this machine has cpu, cuda:0, cuda:1 "
        "(use gpu:0..1, or soft=True to fall back)"
    )


def test_index_beyond_what_cuda_visible_devices_leaves(fake_gpus, monkeypatch) -> None:
    fake_gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    with pytest.raises(
        gk.DeviceError,
        match=r"index 1 is beyond the 1 GPU that CUDA_VISIBLE_DEVICES='2' leaves visible, "
        r"renumbered from 0.*use gpu:0",
    ):
        gk.device("cuda:1")


def test_every_gpu_hidden_by_empty_cuda_visible_devices(fake_gpus, monkeypatch) -> None:
    fake_gpus(0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(gk.DeviceError, match="CUDA_VISIBLE_DEVICES='' hides every GPU"):
        gk.device("gpu:0")


def test_cuda_build_without_gpus_points_at_doctor(fake_gpus) -> None:
    fake_gpus(0)
    with pytest.raises(gk.DeviceError, match=r"torch finds no GPU.*gpukit doctor"):
        gk.device("cuda")


def test_soft_placement_falls_back_with_a_warning_naming_both(fake_gpus) -> None:
    fake_gpus(2)
    with pytest.warns(UserWarning, match=r"device 'gpu:7' is not available.*using cuda:0"):
        assert str(gk.device("gpu:7", soft=True)) == "cuda:0"


def test_soft_placement_on_cpu_machine_falls_back_to_cpu(cpu_only) -> None:
    with pytest.warns(UserWarning, match="using cpu instead"):
        assert gk.device("/gpu:1", soft=True) == gk.cpu()


def test_soft_placement_does_not_excuse_malformed_specs() -> None:
    with pytest.raises(gk.DeviceError, match="not a whole number"):
        gk.device("gpu:one", soft=True)


def test_mps_missing_says_why(cpu_only) -> None:
    with pytest.raises(gk.DeviceError, match="MPS"):
        gk.device("mps")


def test_bare_cuda_means_the_current_device(fake_gpus) -> None:
    fake = fake_gpus(2)
    fake.current.append(1)
    assert str(gk.device("cuda")) == "cuda:1"


def test_gpukit_device_variable_chooses_the_default(fake_gpus, monkeypatch) -> None:
    fake_gpus(2)
    monkeypatch.setenv("GPUKIT_DEVICE", "/gpu:1")
    assert str(gk.device()) == "cuda:1"
    monkeypatch.setenv("GPUKIT_DEVICE", "cpu")
    assert str(gk.device("auto")) == "cpu"
    assert str(gk.device("gpu:0")) == "cuda:0"  # an explicit spec wins over the variable


def test_bad_gpukit_device_variable_is_named(cpu_only, monkeypatch) -> None:
    monkeypatch.setenv("GPUKIT_DEVICE", "tpu:0")
    with pytest.raises(gk.DeviceError, match="GPUKIT_DEVICE='tpu:0' is not a device"):
        gk.device()
    monkeypatch.setenv("GPUKIT_DEVICE", "gpu:3")
    with pytest.raises(gk.DeviceError, match="GPUKIT_DEVICE: unknown device 'gpu:3'"):
        gk.device()
    with pytest.warns(UserWarning, match="using cpu"):
        assert gk.device(soft=True) == gk.cpu()


def test_device_objects_compare_by_type_and_index() -> None:
    a = Device("cuda", 1, "A", 1, (8, 0))
    assert a == Device("cuda", 1) and a != Device("cuda", 0) and hash(a) == hash(Device("cuda", 1))
    assert a.to_dict() == {
        "device": "cuda:1",
        "type": "cuda",
        "index": 1,
        "name": "A",
        "total_memory": 1,
        "compute_capability": "8.0",
    }


def test_a_device_object_is_checked_against_the_machine(cpu_only) -> None:
    with pytest.raises(gk.DeviceError, match="unknown device 'cuda:0': this torch build"):
        gk.device(Device("cuda", 0))


def test_on_sets_the_default_device_for_new_tensors() -> None:
    with gk.on("/cpu:0") as dev:
        assert dev == gk.cpu()
        assert torch.ones(2).device.type == "cpu"
        assert torch.get_default_device() == torch.device("cpu")


def test_on_nests_and_restores_default_and_current_cuda_device(fake_gpus) -> None:
    fake = fake_gpus(2)
    before = torch.get_default_device()
    with gk.on("gpu:1"):
        assert torch.get_default_device() == torch.device("cuda:1")
        assert fake.current[-1] == 1
        with gk.on("/gpu:0"):
            assert torch.get_default_device() == torch.device("cuda:0")
            assert fake.current[-1] == 0
            with gk.on("cpu"):
                assert torch.get_default_device() == torch.device("cpu")
                assert torch.zeros(1).device.type == "cpu"
                assert fake.current[-1] == 0  # the CUDA current device stays put under cpu
            assert torch.get_default_device() == torch.device("cuda:0")
        assert torch.get_default_device() == torch.device("cuda:1")
        assert fake.current[-1] == 1
    assert torch.get_default_device() == before and fake.current == [0]


def test_on_restores_the_device_when_the_body_raises() -> None:
    before = torch.get_default_device()
    with pytest.raises(KeyError), gk.on("cpu"):
        raise KeyError("boom")
    assert torch.get_default_device() == before


def test_on_rejects_a_missing_device_before_changing_anything(cpu_only) -> None:
    before = torch.get_default_device()
    with pytest.raises(gk.DeviceError), gk.on("gpu:0"):
        pass
    assert torch.get_default_device() == before


@pytest.mark.gpu
def test_real_gpus_are_listed_with_name_memory_and_capability() -> None:
    found = [d for d in gk.devices() if d.type == "cuda"]
    assert found and all(d.name and d.total_memory and d.compute_capability for d in found)
    assert gk.device() == found[0] and gk.device("/gpu:0") == found[0]
    with gk.on("gpu:0"):
        assert torch.ones(1).device == torch.device("cuda:0")
        assert torch.cuda.current_device() == 0


def test_gpu_where_cuda_cannot_start_is_missing_with_the_reason(fake_gpus) -> None:
    fake = fake_gpus(2)
    fake.broken[1] = "CUDA error: all CUDA-capable devices are busy or unavailable"
    assert [str(d) for d in gk.devices()] == ["cpu", "cuda:0"]  # the rest stays usable
    assert str(gk.device("cpu")) == "cpu"
    with pytest.raises(
        gk.DeviceError,
        match=r"CUDA cannot start on GPU 1: CUDA error: all "
        r"CUDA-capable devices are busy",
    ):
        gk.device("gpu:1")


def test_device_objects_are_validated_like_their_spelling(cpu_only) -> None:
    with pytest.raises(gk.DeviceError, match="only one cpu device"):
        gk.device(Device("cpu", 3))
    with pytest.raises(gk.DeviceError, match="negative"):
        gk.device(Device("cuda", -1))
    with pytest.raises(gk.DeviceError, match="TPUs are not supported"):
        gk.device(Device("tpu"))  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["cuda:" + "9" * 5000, "9" * 5000, "/gpu:" + "9" * 30])
def test_absurd_indices_are_device_errors(spec: str) -> None:
    with pytest.raises(gk.DeviceError, match="too large"):
        gk.device(spec)


def test_soft_fallback_warning_points_at_the_callers_line(cpu_only) -> None:
    with pytest.warns(UserWarning) as caught:
        gk.device("gpu:2", soft=True)
    assert caught[0].filename == __file__


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.integers(), st.text(alphabet="/:gpucdajobGPUCD0123456789 -")))
def test_any_spec_resolves_or_raises_a_gpukit_error(spec: object) -> None:
    try:
        dev = gk.device(spec)
    except gk.GpukitError:
        return
    assert dev in gk.devices()
