"""NVML's readings of a rank's GPU, on a fake pynvml: the device mapped through
CUDA_VISIBLE_DEVICES, throttle reasons in words, other processes, at most once a second, and a
note (never an exception) when NVML is missing or refuses."""

from __future__ import annotations

import types
from typing import Any

from gpukit.launch.gpu_watch import GpuWatch, throttle_words


class NVMLError(Exception):
    pass


def fake_nvml(init_error: Exception | None = None) -> Any:
    calls: list[str] = []
    gpus = {
        "0": {"name": b"NVIDIA H100", "uuid": "GPU-aaa", "mask": 0x1, "pids": [10]},
        "1": {"name": "NVIDIA H100", "uuid": "GPU-bbb", "mask": 0x4 | 0x20, "pids": [11, 99]},
    }

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    def by_index(index: int) -> dict[str, Any]:
        calls.append(f"index {index}")
        return gpus[str(index)]

    def by_uuid(uuid: str) -> dict[str, Any]:
        for gpu in gpus.values():
            if gpu["uuid"] == uuid:
                return gpu
        raise NVMLError("Not Found")

    def unsupported(handle: Any, *args: Any) -> Any:
        raise NVMLError("Not Supported")

    return types.SimpleNamespace(
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetName=lambda h: h["name"],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetPowerUsage=lambda h: 650_000,
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,
        nvmlDeviceGetTemperature=lambda h, sensor: 71,
        nvmlDeviceGetClockInfo=lambda h, clock: 1500,
        nvmlDeviceGetMaxClockInfo=unsupported,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: h["mask"],
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=p, usedGpuMemory=1) for p in h["pids"]
        ],
    )


def test_a_gpu_is_read_in_words_and_numbers() -> None:
    nvml = fake_nvml()
    reading, note = GpuWatch(None, nvml=nvml).read(1, pids={11}, now=0.0)
    assert note == ""
    assert reading == {
        "index": 1,
        "name": "NVIDIA H100",
        "util": 97,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "temp_c": 71,
        "sm_clock_mhz": 1500,
        "max_sm_clock_mhz": None,  # unsupported on this GPU: unknown, not an error
        "throttle": ["power cap", "thermal"],
        "other_processes": 1,  # pid 99 is not one of the job's
    }


def test_other_processes_are_unknown_where_nvml_names_none_of_the_job_s() -> None:
    # In a container NVML gives the host's pids: the job's rank 11 shows as, say, 4711.
    reading, _ = GpuWatch(None, nvml=fake_nvml()).read(1, pids={4711}, now=0.0)
    assert reading is not None and reading["other_processes"] is None
    reading, _ = GpuWatch(None, nvml=fake_nvml()).read(0, pids={10, 12}, now=0.0)
    assert reading is not None and reading["other_processes"] == 0


def test_the_rank_s_device_is_mapped_through_cuda_visible_devices() -> None:
    nvml = fake_nvml()
    watch = GpuWatch("1,0", nvml=nvml)
    reading, _ = watch.read(0, pids=set(), now=0.0)
    assert reading is not None and reading["throttle"] == ["power cap", "thermal"]
    assert "index 1" in nvml.calls
    by_uuid = GpuWatch("GPU-aaa", nvml=fake_nvml())
    reading, _ = by_uuid.read(0, pids={10}, now=0.0)
    assert reading is not None and reading["name"] == "NVIDIA H100" and reading["throttle"] == []
    reading, note = by_uuid.read(3, pids=set(), now=0.0)
    assert reading is None and note == "GPU 3: not among CUDA_VISIBLE_DEVICES=GPU-aaa"
    reading, note = GpuWatch("GPU-zzz", nvml=fake_nvml()).read(0, pids=set(), now=0.0)
    assert reading is None and note == "NVML refused GPU GPU-zzz: Not Found"


def test_nvml_is_asked_at_most_once_a_second_and_initialised_once() -> None:
    nvml = fake_nvml()
    watch = GpuWatch(None, nvml=nvml)
    for now in (0.0, 0.3, 0.9, 1.0, 1.5):
        watch.read(0, pids=set(), now=now)
    assert nvml.calls.count("index 0") == 2 and nvml.calls.count("init") == 1
    watch.close()
    assert nvml.calls[-1] == "shutdown"


def test_nvml_missing_or_refusing_is_a_note() -> None:
    reading, note = GpuWatch(None, nvml=None).read(0, pids=set(), now=0.0)
    assert reading is None
    assert note == "NVML: not installed (pip install nvidia-ml-py): no GPU readings"
    refusing = fake_nvml(NVMLError("Driver Not Loaded"))
    reading, note = GpuWatch(None, nvml=refusing).read(0, pids=set(), now=0.0)
    assert reading is None and note == "NVML refused: Driver Not Loaded: no GPU readings"


def test_a_rank_on_the_cpu_has_nothing_to_read_or_say() -> None:
    nvml = fake_nvml()
    assert GpuWatch(None, nvml=nvml).read(-1, pids=set(), now=0.0) == (None, "")
    assert nvml.calls == []


def test_throttle_reasons_leave_idle_out() -> None:
    assert throttle_words(0x1) == []
    assert throttle_words(0x8 | 0x80) == ["hardware slowdown", "power brake"]
