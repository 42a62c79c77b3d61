"""The doctor on pretend machines: NVML through a fake pynvml module, torch facts by hand."""

from __future__ import annotations

import pytest

from gpukit.devices import nvml as _nvml
from gpukit.doctor import Check, DoctorReport, evaluate
from gpukit.doctor.gpus import has_kernels
from tests.fakes import (
    GiB,
    NVMLError,
    NVMLError_LibraryNotFound,
    cpu_torch,
    cuda_torch,
    fake_pynvml,
    h100s,
    install_pynvml,
    system,
    torch_gpu,
)


def run(monkeypatch, torch_info, nvml_gpus=None, cuda=12040, **env) -> DoctorReport:  # type: ignore[no-untyped-def]
    if nvml_gpus is None:
        module = fake_pynvml(
            [], init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        )
    else:
        module = fake_pynvml(nvml_gpus, cuda=cuda)
    install_pynvml(monkeypatch, module)
    return evaluate(system(**env), torch_info, _nvml.read())


def check(report: DoctorReport, name: str) -> Check:
    matches = [c for c in report.checks if c.name == name]
    assert matches, f"no check {name!r} in {[c.name for c in report.checks]}"
    return matches[0]


def test_cpu_only_machine_is_a_valid_setup(monkeypatch) -> None:
    report = run(monkeypatch, cpu_torch())
    assert report.ok and report.status == "WARN"
    assert check(report, "gpus") == Check(
        "gpus", "WARN", "no GPU, gpukit runs on CPU", check(report, "gpus").fix
    )
    assert check(report, "nvidia driver").status == "OK"
    assert [c.name for c in report.checks if c.status != "OK"] == ["gpus"]
    assert "precision" not in {c.name for c in report.checks}


def test_gpu_present_but_cpu_only_torch_fails_with_install_fix(monkeypatch) -> None:
    report = run(monkeypatch, cpu_torch(), h100s(1))
    gpus = check(report, "gpus")
    assert gpus.status == "FAIL" and not report.ok
    assert "NVML sees 1 NVIDIA GPU (0: NVIDIA H100 80GB HBM3)" in gpus.detail
    assert "CPU-only" in gpus.detail and "pip install torch" in gpus.fix


def test_driver_too_old_for_torch_cuda_runtime_fails(monkeypatch) -> None:
    warning = (
        "CUDA initialization: The NVIDIA driver on your system is too old (found version 11040)."
    )
    info = cuda_torch(0, cuda_runtime="12.4", cuda_init_warning=warning)
    report = run(monkeypatch, info, h100s(2), cuda=11040)
    driver = check(report, "nvidia driver")
    assert driver.status == "FAIL"
    assert "supports CUDA up to 11.4: too old for torch's CUDA 12.4" in driver.detail
    assert "too old (found version 11040)" in driver.detail
    assert "upgrade the NVIDIA driver" in driver.fix
    gpus = check(report, "gpus")
    assert gpus.status == "FAIL" and "torch sees 0 of the 2 GPUs" in gpus.detail
    assert not report.ok


def test_driver_one_minor_behind_warns_about_minor_version_compatibility(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1, cuda_runtime="12.4"), h100s(1), cuda=12020)
    driver = check(report, "nvidia driver")
    assert driver.status == "WARN" and "minor-version compatibility" in driver.detail
    assert report.ok


def test_driver_new_enough_is_ok(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1), h100s(1), cuda=12080)
    assert check(report, "nvidia driver") == Check(
        "nvidia driver", "OK", "550.54.15, supports CUDA up to 12.8 (torch needs 12.4)"
    )


def test_gpu_architecture_missing_from_build_fails(monkeypatch) -> None:
    blackwell = torch_gpu(0, name="NVIDIA RTX PRO 6000", capability=(12, 0))
    report = run(monkeypatch, cuda_torch((blackwell,)), h100s(1), cuda=12080)
    gpu = check(report, "gpu cuda:0")
    assert gpu.status == "FAIL" and "no kernels for sm_120" in gpu.detail
    assert "sm_90" in gpu.detail and "install a torch build" in gpu.fix


@pytest.mark.parametrize(
    ("capability", "archs", "expected"),
    [
        ((8, 9), ("sm_80", "sm_86"), True),  # same major, newer minor runs sm_86 code
        ((8, 0), ("sm_86",), False),  # older minor cannot
        ((12, 0), ("sm_90", "compute_90"), True),  # PTX is compiled for newer GPUs
        ((9, 0), ("sm_90a",), True),
        ((10, 0), ("sm_90a",), False),  # arch-specific code runs only on its own GPU
        ((7, 0), ("sm_80", "compute_80"), False),
        ((9, 0), (), True),
    ],
)
def test_kernel_compatibility_rules(capability, archs, expected) -> None:  # type: ignore[no-untyped-def]
    assert has_kernels(capability, archs) is expected


def test_two_gpus_without_peer_to_peer_warn(monkeypatch) -> None:
    info = cuda_torch(2, p2p=((True, False), (False, True)))
    report = run(monkeypatch, info, h100s(2))
    p2p = check(report, "peer-to-peer")
    assert p2p.status == "WARN" and "cuda:0->cuda:1, cuda:1->cuda:0" in p2p.detail
    assert "nvidia-smi topo -m" in p2p.fix
    assert report.to_dict()["p2p"] == {
        "devices": ["cuda:0", "cuda:1"],
        "matrix": [[True, False], [False, True]],
    }


def test_two_gpus_with_peer_to_peer_are_ok(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(2), h100s(2))
    assert check(report, "peer-to-peer").status == "OK"
    assert report.status == "OK"


def test_empty_cuda_visible_devices_hides_every_gpu(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(0), h100s(2), CUDA_VISIBLE_DEVICES="")
    gpus = check(report, "gpus")
    assert gpus.status == "WARN" and "CUDA_VISIBLE_DEVICES='' hides all 2 GPUs" in gpus.detail
    assert "unset CUDA_VISIBLE_DEVICES" in gpus.fix and report.ok


def test_cuda_visible_devices_subset_names_the_hidden_gpus(monkeypatch) -> None:
    nvml = [{"name": "NVIDIA A100", "uuid": "GPU-a"}, {"name": "NVIDIA H100", "uuid": "GPU-b"}]
    info = cuda_torch((torch_gpu(0, name="NVIDIA H100", uuid="GPU-b"),))
    report = run(monkeypatch, info, nvml, CUDA_VISIBLE_DEVICES="1")
    gpus = check(report, "gpus")
    assert gpus.status == "OK" and "torch sees 1 of 2" in gpus.detail
    assert "hides 0: NVIDIA A100" in gpus.detail


def test_cuda_visible_devices_naming_no_gpu(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(0), h100s(2), CUDA_VISIBLE_DEVICES="7")
    assert "names no GPU of this machine" in check(report, "gpus").detail


def test_per_gpu_check_uses_nvml_memory_and_utilisation(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1), h100s(1, used=10 * GiB, util=42))
    gpu = check(report, "gpu cuda:0")
    assert gpu.status == "OK"
    assert gpu.detail == (
        "NVIDIA H100 80GB HBM3, 80 GiB total, 10 GiB used, 70 GiB free, "
        "compute 9.0, utilisation 42%; test allocation ok"
    )


def test_nearly_full_gpu_warns(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1), h100s(1, used=79 * GiB))
    assert check(report, "gpu cuda:0").status == "WARN"


def test_failed_test_allocation_fails(monkeypatch) -> None:
    bad = torch_gpu(0, alloc_error="AcceleratorError: CUDA error: uncorrectable ECC error")
    report = run(monkeypatch, cuda_torch((bad,)), h100s(1))
    gpu = check(report, "gpu cuda:0")
    assert gpu.status == "FAIL" and "uncorrectable ECC error" in gpu.detail


def test_without_nvml_the_gpu_report_degrades_to_torch(monkeypatch) -> None:
    install_pynvml(monkeypatch, None)
    report = evaluate(system(), cuda_torch(1), _nvml.read())
    driver = check(report, "nvidia driver")
    assert driver.status == "WARN" and "pip install nvidia-ml-py" in driver.fix
    gpu = check(report, "gpu cuda:0")
    assert gpu.status == "OK" and "79 GiB free" in gpu.detail and "utilisation ?" in gpu.detail
    assert report.to_dict()["nvml"]["available"] is False


def test_cudnn_version_mismatch_fails(monkeypatch) -> None:
    err = (
        "cuDNN version incompatibility: PyTorch was compiled  against (9, 1, 0) but found "
        "runtime version (8, 9, 2)."
    )
    report = run(monkeypatch, cuda_torch(1, cudnn_version=None, cudnn_error=err), h100s(1))
    cudnn = check(report, "cudnn")
    assert cudnn.status == "FAIL" and "incompatibility" in cudnn.detail
    assert "LD_LIBRARY_PATH" in cudnn.fix


def test_cudnn_version_is_spelled_out(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1), h100s(1))
    assert check(report, "cudnn").detail == "9.1.0 (90100), enabled"
    old = run(monkeypatch, cuda_torch(1, cudnn_version=8902), h100s(1))
    assert check(old, "cudnn").detail == "8.9.2 (8902), enabled"


def test_old_torch_fails(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1, version="2.1.0+cu121"), h100s(1))
    assert check(report, "torch").status == "FAIL"


def test_mixed_gpu_models_warn_about_numbering(monkeypatch) -> None:
    nvml = [
        {"name": "NVIDIA A100", "uuid": "GPU-00000000"},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-00000001"},
    ]
    report = run(monkeypatch, cuda_torch(2), nvml)
    assert check(report, "gpu numbering").fix == "export CUDA_DEVICE_ORDER=PCI_BUS_ID"
    fixed = run(monkeypatch, cuda_torch(2), nvml, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert "gpu numbering" not in {c.name for c in fixed.checks}


def test_launch_blocking_left_on_warns(monkeypatch) -> None:
    report = run(monkeypatch, cpu_torch(), CUDA_LAUNCH_BLOCKING="1")
    env = check(report, "environment")
    assert env.status == "WARN" and "CUDA_LAUNCH_BLOCKING=1" in env.detail


def test_precision_reports_bf16_and_tf32(monkeypatch) -> None:
    report = run(monkeypatch, cuda_torch(1), h100s(1))
    assert "bf16 on every GPU" in check(report, "precision").detail
    old = torch_gpu(0, name="Tesla V100", capability=(7, 0), bf16=False)
    report = run(monkeypatch, cuda_torch((old,)), h100s(1))
    detail = check(report, "precision").detail
    assert "no bf16" in detail and "TF32 not supported" in detail


def test_mps_is_checked_on_macos_only(monkeypatch) -> None:
    install_pynvml(monkeypatch, None)
    mac = system()
    mac = type(mac)(**{**vars(mac), "platform": "darwin"})
    report = evaluate(mac, cpu_torch(mps_built=True, mps_available=True), _nvml.read())
    assert check(report, "mps").status == "OK"
    report = evaluate(mac, cpu_torch(mps_built=True), _nvml.read())
    assert check(report, "mps").status == "WARN"


def test_json_schema_is_stable(monkeypatch) -> None:
    data = run(monkeypatch, cuda_torch(2), h100s(2)).to_dict()
    assert set(data) == {"schema_version", "status", "checks", "devices", "nvml", "p2p"}
    assert data["schema_version"] == 1
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in data["checks"])
    assert [d["device"] for d in data["devices"]] == ["cpu", "cuda:0", "cuda:1"]
    assert set(data["devices"][1]) >= {
        "name",
        "total_memory",
        "compute_capability",
        "test_allocation",
    }
    assert data["nvml"]["cuda_driver_version"] == "12.4"
    assert data["nvml"]["gpus"][0]["uuid"] == "GPU-00000000"


def test_nvml_library_mismatch_fails_with_reboot_fix(monkeypatch) -> None:
    install_pynvml(
        monkeypatch, fake_pynvml([], init_error=NVMLError("Driver/library version mismatch"))
    )
    report = evaluate(system(), cuda_torch(0), _nvml.read())
    driver = check(report, "nvidia driver")
    assert driver.status == "FAIL" and "Driver/library version mismatch" in driver.detail
    assert "reboot" in driver.fix and not report.ok


def test_gpu_where_cuda_cannot_start_fails_and_the_rest_is_reported(monkeypatch) -> None:
    info = cuda_torch(1, unreadable=((1, "CUDA error: all CUDA-capable devices are busy"),))
    report = run(monkeypatch, info, h100s(2))
    bad = check(report, "gpu cuda:1")
    assert bad.status == "FAIL" and "devices are busy" in bad.detail
    assert check(report, "gpu cuda:0").status == "OK"
    assert "cuda:1 (cannot start)" in check(report, "gpus").detail


def test_skipped_test_allocation_says_skipped(monkeypatch) -> None:
    info = cuda_torch((torch_gpu(0, alloc_tested=False),))
    report = run(monkeypatch, info, h100s(1))
    assert check(report, "gpu cuda:0").detail.endswith("test allocation skipped")
    assert report.to_dict()["devices"][1]["test_allocation"] == "skipped"


def test_old_driver_under_a_scheduler_blames_the_driver_not_the_variable(monkeypatch) -> None:
    warning = "CUDA initialization: The NVIDIA driver on your system is too old"
    info = cuda_torch(0, cuda_init_warning=warning)
    report = run(monkeypatch, info, h100s(2), cuda=11040, CUDA_VISIBLE_DEVICES="0")
    gpus = check(report, "gpus")
    assert gpus.status == "FAIL" and "torch sees 0 of the 2 GPUs" in gpus.detail
    assert "too old" in gpus.detail


def test_cuda_visible_devices_by_uuid_prefix(monkeypatch) -> None:
    info = cuda_torch((torch_gpu(0, uuid="GPU-00000001"),))
    report = run(monkeypatch, info, h100s(2), CUDA_VISIBLE_DEVICES="GPU-0000000")
    gpus = check(report, "gpus")  # an ambiguous prefix: which GPU is hidden is not known
    assert gpus.status == "OK" and gpus.detail.endswith("hides the others")
    report = run(monkeypatch, info, h100s(2), CUDA_VISIBLE_DEVICES="GPU-00000001")
    gpus = check(report, "gpus")
    assert gpus.status == "OK" and "hides 0: NVIDIA H100 80GB HBM3" in gpus.detail


def test_mixed_models_without_uuids_are_not_matched_by_position(monkeypatch) -> None:
    nvml = [
        {"name": "NVIDIA RTX A2000", "uuid": "GPU-x", "util": 99, "used": 5 * GiB},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-y", "util": 1},
    ]
    info = cuda_torch((torch_gpu(0, uuid=None), torch_gpu(1, uuid=None, name="NVIDIA RTX A2000")))
    gpu0 = check(run(monkeypatch, info, nvml), "gpu cuda:0")
    assert "utilisation ?" in gpu0.detail and "79 GiB free" in gpu0.detail
    ordered = run(monkeypatch, info, nvml, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert "utilisation 99%" in check(ordered, "gpu cuda:0").detail


def test_numbering_warning_needs_two_visible_gpus(monkeypatch) -> None:
    nvml = [{"name": "NVIDIA A100", "uuid": "GPU-00000000"}, {"name": "NVIDIA H100"}]
    report = run(monkeypatch, cuda_torch(1), nvml, CUDA_VISIBLE_DEVICES="0")
    assert "gpu numbering" not in {c.name for c in report.checks}


def test_every_device_row_has_the_same_keys(monkeypatch) -> None:
    rows = run(monkeypatch, cuda_torch(1), h100s(1)).to_dict()["devices"]
    assert len(rows) == 2 and set(rows[0]) == set(rows[1])
    assert rows[0]["bf16"] is None and rows[1]["bf16"] is True
