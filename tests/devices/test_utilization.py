"""Sampling GPU utilisation through a fake pynvml: GPUs matched by UUID, figures over a span,
and a sampler that never raises, whatever NVML does."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from gpukit.devices.utilization import UtilizationSampler
from tests.fakes import NVMLError, NVMLError_LibraryNotFound, fake_pynvml, h100s, install_pynvml

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def busy_pynvml(gpus: list[dict], readings: dict[str, list[int]]):  # type: ignore[no-untyped-def]
    """A fake pynvml whose GPU with UUID u reports readings[u] in turn (the last one after)."""
    module = fake_pynvml(gpus)
    calls: dict[str, int] = {}

    def utilization(handle: dict) -> SimpleNamespace:
        uuid = handle["uuid"]
        n = calls[uuid] = calls.get(uuid, -1) + 1
        values = readings[uuid]
        return SimpleNamespace(gpu=values[min(n, len(values) - 1)], memory=0)

    module.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    return module


def test_each_cuda_device_is_matched_to_its_gpu_by_uuid(monkeypatch, fake_gpus) -> None:
    fake_gpus(2)  # torch sees GPU-00000000 as cuda:0 and GPU-00000001 as cuda:1
    nvml_order = list(reversed(h100s(2)))  # NVML lists them the other way round
    readings = {"GPU-00000000": [10, 30], "GPU-00000001": [90, 100]}
    install_pynvml(monkeypatch, busy_pynvml(nvml_order, readings))
    with UtilizationSampler([CUDA0, CUDA1], interval=0.01) as util:
        time.sleep(0.05)
    stats = util.stats()
    assert util.error is None
    a, b = stats["cuda:0"], stats["cuda:1"]
    assert a is not None and b is not None
    assert a.max == 30 and 10 <= a.mean <= 30 and a.samples >= 2
    assert b.max == 100 and 90 <= b.mean <= 100
    assert a.to_dict()["device"] == "cuda:0"


def test_the_span_keeps_only_its_samples_and_the_one_just_after(monkeypatch, fake_gpus) -> None:
    fake_gpus(1)
    install_pynvml(monkeypatch, busy_pynvml(h100s(1), {"GPU-00000000": [50]}))
    sampler = UtilizationSampler([CUDA0], interval=0.5)
    sampler.samples["cuda:0"] = [(1.0, 0.0), (2.0, 80.0), (3.0, 100.0), (3.4, 60.0), (9.0, 0.0)]
    span = sampler.stats(start=1.5, end=3.0)["cuda:0"]
    assert span is not None and (span.samples, span.max, span.mean) == (3, 100.0, 80.0)
    assert sampler.stats(start=20.0)["cuda:0"] is None  # nothing sampled then: unknown, not 0


def test_without_the_package_the_figures_are_none_and_say_why(monkeypatch, fake_gpus) -> None:
    fake_gpus(1)
    install_pynvml(monkeypatch, None)
    with UtilizationSampler([CUDA0]) as util:
        pass
    assert util.stats() == {"cuda:0": None}
    assert "nvidia-ml-py" in (util.error or "")


def test_nvml_that_cannot_start_gives_none(monkeypatch, fake_gpus) -> None:
    fake_gpus(1)
    error = NVMLError_LibraryNotFound("NVML Shared Library Not Found")
    install_pynvml(monkeypatch, fake_pynvml(h100s(1), init_error=error))
    with UtilizationSampler([CUDA0]) as util:
        pass
    assert util.stats() == {"cuda:0": None}
    assert "Library Not Found" in (util.error or "")


def test_a_failing_query_never_reaches_the_work(monkeypatch, fake_gpus) -> None:
    fake_gpus(2)
    module = fake_pynvml(h100s(2))

    def utilization(handle: dict) -> SimpleNamespace:
        if handle["uuid"] == "GPU-00000001":
            raise NVMLError("GPU is lost")
        return SimpleNamespace(gpu=70)

    module.nvmlDeviceGetUtilizationRates = utilization  # type: ignore[attr-defined]
    install_pynvml(monkeypatch, module)
    with UtilizationSampler([CUDA0, CUDA1], interval=0.01) as util:
        time.sleep(0.03)
    stats = util.stats()
    assert stats["cuda:1"] is None and "GPU is lost" in (util.error or "")
    assert stats["cuda:0"] is not None and stats["cuda:0"].mean == 70


def test_a_gpu_nvml_does_not_list_is_none_and_named(monkeypatch, fake_gpus) -> None:
    fake_gpus(2)
    install_pynvml(monkeypatch, busy_pynvml(h100s(1), {"GPU-00000000": [5]}))
    with UtilizationSampler([CUDA0, CUDA1], interval=0.01) as util:
        pass
    assert util.stats()["cuda:1"] is None and util.stats()["cuda:0"] is not None
    assert "cuda:1" in (util.error or "")


def test_an_error_while_starting_is_kept_not_raised(monkeypatch, fake_gpus) -> None:
    fake_gpus(1)
    module = fake_pynvml(h100s(1))

    def count() -> int:
        raise NVMLError("Unknown Error")

    module.nvmlDeviceGetCount = count  # type: ignore[attr-defined]
    install_pynvml(monkeypatch, module)
    with UtilizationSampler([CUDA0]) as util:
        pass
    assert util.stats() == {"cuda:0": None} and "Unknown Error" in (util.error or "")


def test_cpu_devices_are_left_out_and_no_thread_starts(monkeypatch) -> None:
    install_pynvml(monkeypatch, fake_pynvml(h100s(1)))
    with UtilizationSampler([torch.device("cpu")]) as util:
        assert util._thread is None
    assert util.stats() == {} and util.error is None


def test_the_sampling_thread_ends_with_the_block(monkeypatch, fake_gpus) -> None:
    fake_gpus(1)
    install_pynvml(monkeypatch, busy_pynvml(h100s(1), {"GPU-00000000": [1]}))
    with UtilizationSampler([CUDA0], interval=0.01) as util:
        thread = util._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
