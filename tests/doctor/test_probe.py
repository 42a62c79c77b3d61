"""Reading facts from the real torch here, and from torch pretending to see GPUs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from gpukit.cli.__main__ import main
from gpukit.devices import hw as _hw
from gpukit.doctor import diagnose
from gpukit.doctor.probe import read_system, read_torch
from tests.fakes import fake_pynvml, h100s, install_pynvml


def test_reads_this_cpu_build() -> None:
    info = read_torch()
    assert info.version == torch.__version__
    if torch.version.cuda is None:
        assert info.build == "cpu" and info.gpus == () and info.cudnn_version is None
        assert info.nccl_version is None and info.arch_list == ()
    assert info.gloo == torch.distributed.is_gloo_available()


def test_reads_system_and_only_watched_variables(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    info = read_system()
    assert info.cores >= info.usable_cores >= 1 and info.python[0] == 3
    assert info.env.get("NCCL_DEBUG") == "INFO" and "UNRELATED_SECRET" not in info.env


def test_pretend_gpus_are_read_and_a_failing_allocation_is_recorded(fake_gpus, monkeypatch) -> None:
    fake_gpus(2, capability=(8, 0))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) == (0, 1))
    info = read_torch()
    assert [g.name for g in info.gpus] == ["NVIDIA H100 80GB HBM3"] * 2
    assert all(g.bf16 and g.capability == (8, 0) for g in info.gpus)
    assert info.p2p == ((True, True), (False, True))
    # torch cannot allocate on a pretend GPU: the test allocation catches that and says so.
    assert all(g.alloc_error and g.allocation == g.alloc_error for g in info.gpus)
    assert read_torch(test_allocation=False).gpus[0].allocation == "skipped"


def test_a_gpu_where_cuda_cannot_start_is_recorded_not_raised(fake_gpus) -> None:
    fake = fake_gpus(2)
    fake.broken[0] = "CUDA error: uncorrectable ECC error encountered"
    info = read_torch(test_allocation=False)
    assert [g.index for g in info.gpus] == [1]
    assert info.unreadable == ((0, "CUDA error: uncorrectable ECC error encountered"),)
    assert info.p2p == ()


def test_cuda_properties_gives_nvml_style_uuids(monkeypatch) -> None:
    props = SimpleNamespace(
        name="NVIDIA H100",
        total_memory=80,
        major=9,
        minor=0,
        uuid="1e2b3c4d-0000-1111-2222-333344445555",
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    read = _hw.cuda_properties(0)
    assert read.uuid == "GPU-1e2b3c4d-0000-1111-2222-333344445555"
    assert (read.name, read.total_memory, read.capability) == ("NVIDIA H100", 80, (9, 0))


def test_diagnose_this_machine_is_not_a_failure() -> None:
    report = diagnose()
    assert report.ok, [c for c in report.checks if c.status == "FAIL"]
    names = [c.name for c in report.checks]
    assert names[:4] == ["os", "python", "cpu", "ram"] and "torch" in names and "gpus" in names


@pytest.mark.gpu
def test_real_gpu_is_read_and_passes_the_test_allocation() -> None:
    info = read_torch()
    assert info.build == "cuda" and info.gpus and info.arch_list and info.cudnn_version
    assert all(g.alloc_error is None and g.total_memory > 0 for g in info.gpus)
    assert diagnose().ok


def test_whole_doctor_on_a_gpu_machine_with_cpu_only_torch(cpu_only, monkeypatch, capsys) -> None:
    install_pynvml(monkeypatch, fake_pynvml(h100s(2)))
    report = diagnose()
    gpus = next(c for c in report.checks if c.name == "gpus")
    assert gpus.status == "FAIL" and "NVML sees 2 NVIDIA GPUs" in gpus.detail
    assert main(["doctor", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["status"] == "FAIL" and data["nvml"]["driver_version"] == "550.54.15"
