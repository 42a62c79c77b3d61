"""Reading NVML through a fake pynvml module, and degrading when it is absent."""

from __future__ import annotations

from gpukit.devices import nvml as _nvml
from tests.fakes import GiB, NVMLError, NVMLError_LibraryNotFound, fake_pynvml, install_pynvml


def test_reads_driver_cuda_version_and_every_gpu(monkeypatch) -> None:
    gpus = [
        {"name": "NVIDIA A100", "uuid": "GPU-a", "util": 37, "cc": (8, 0)},
        {"name": "NVIDIA A100", "uuid": "GPU-b"},
    ]
    install_pynvml(monkeypatch, fake_pynvml(gpus))
    info = _nvml.read()
    assert info.available and info.driver_version == "550.54.15"
    assert info.cuda_driver_version == (12, 4)
    a, b = info.gpus
    assert (a.name, a.uuid, a.utilization, a.capability) == ("NVIDIA A100", "GPU-a", 37, (8, 0))
    assert a.memory_total == 80 * GiB and a.memory_free == 79 * GiB
    assert b.utilization is None  # unsupported query: unknown, not an error


def test_missing_driver_library_degrades_with_a_reason(monkeypatch) -> None:
    error = NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    install_pynvml(monkeypatch, fake_pynvml([], init_error=error))
    info = _nvml.read()
    assert not info.available and info.gpus == ()
    assert info.error == "libnvidia-ml.so not found: no NVIDIA driver is installed"
    assert info.absence == "no-driver"


def test_missing_package_degrades_with_a_reason(monkeypatch) -> None:
    # Importing a module whose sys.modules entry is None raises ImportError.
    install_pynvml(monkeypatch, None)
    info = _nvml.read()
    assert not info.available and "nvidia-ml-py" in (info.error or "")
    assert info.absence == "no-package"


def test_one_lost_gpu_keeps_the_driver_and_the_other_gpus(monkeypatch) -> None:
    module = fake_pynvml([{"name": "NVIDIA A100", "uuid": "GPU-a"}, {"name": "lost"}])
    real_name = module.nvmlDeviceGetName  # type: ignore[attr-defined]

    def name(handle: dict) -> bytes:
        if handle["name"] == "lost":
            raise NVMLError("GPU is lost")
        return real_name(handle)

    module.nvmlDeviceGetName = name  # type: ignore[attr-defined]
    install_pynvml(monkeypatch, module)
    info = _nvml.read()
    assert info.available and info.driver_version == "550.54.15"
    assert info.gpus[0].name == "NVIDIA A100" and info.gpus[0].error is None
    assert info.gpus[1].error == "GPU is lost"


def test_nvml_that_fails_to_start_is_an_error_not_an_absence(monkeypatch) -> None:
    mismatch = NVMLError("Driver/library version mismatch")
    install_pynvml(monkeypatch, fake_pynvml([], init_error=mismatch))
    info = _nvml.read()
    assert not info.available and info.absence == "error"
    assert info.error == "Driver/library version mismatch"
