"""Builders of pretend machines for the doctor's tests."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from gpukit.doctor.probe import SystemInfo, TorchGpu, TorchInfo

GiB = 1024**3


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


def fake_pynvml(
    gpus: list[dict[str, Any]],
    driver: str = "550.54.15",
    cuda: int = 12040,
    init_error: Exception | None = None,
) -> types.ModuleType:
    """A stand-in for the pynvml module describing ``gpus`` (dicts of name, uuid, util, ...;
    "processes"/"graphics": running processes as [(pid, used bytes or None)])."""
    m: Any = types.ModuleType("pynvml")
    m.NVMLError = NVMLError

    def init() -> None:
        if init_error:
            raise init_error

    def utilization(h: dict[str, Any]) -> SimpleNamespace:
        if "util" not in h:
            raise NVMLError("Not Supported")
        return SimpleNamespace(gpu=h["util"])

    def memory(h: dict[str, Any]) -> SimpleNamespace:
        total, used = h.get("total", 80 * GiB), h.get("used", GiB)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def processes(key: str) -> Any:
        def running(h: dict[str, Any]) -> list[SimpleNamespace]:
            # h[key]: [(pid, used bytes or None), ...]; None plays an unsupported query.
            if key in h and h[key] is None:
                raise NVMLError("Not Supported")
            return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.get(key, [])]

        return running

    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: driver
    m.nvmlSystemGetCudaDriverVersion = lambda: cuda
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetName = lambda h: h["name"].encode()
    m.nvmlDeviceGetUUID = lambda h: h.get("uuid", "")
    m.nvmlDeviceGetPciInfo = lambda h: SimpleNamespace(busId=h.get("bus", "00000000:01:00.0"))
    m.nvmlDeviceGetMemoryInfo = memory
    m.nvmlDeviceGetUtilizationRates = utilization
    m.nvmlDeviceGetCudaComputeCapability = lambda h: h.get("cc", (9, 0))
    m.nvmlDeviceGetComputeRunningProcesses = processes("processes")
    m.nvmlDeviceGetGraphicsRunningProcesses = processes("graphics")
    return m


def install_pynvml(monkeypatch: Any, module: types.ModuleType | None) -> None:
    """Make ``import pynvml`` give ``module`` (None: as if the package were not installed)."""
    monkeypatch.setitem(sys.modules, "pynvml", module)


def h100s(n: int, **kw: Any) -> list[dict[str, Any]]:
    return [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i:08d}", "util": 3, **kw} for i in range(n)
    ]


def system(**env: str) -> SystemInfo:
    return SystemInfo(
        os="Linux-6.8-x86_64",
        platform="linux",
        python=(3, 11, 7),
        cores=16,
        usable_cores=16,
        ram_total=128 * GiB,
        ram_available=100 * GiB,
        env=env,
    )


def torch_gpu(i: int, **kw: Any) -> TorchGpu:
    base = TorchGpu(
        index=i,
        name="NVIDIA H100 80GB HBM3",
        total_memory=80 * GiB,
        capability=(9, 0),
        uuid=f"GPU-{i:08d}",
        free_memory=79 * GiB,
        bf16=True,
    )
    return replace(base, **kw)


def cuda_torch(gpus: int | tuple[TorchGpu, ...] = 1, **kw: Any) -> TorchInfo:
    """A CUDA 12.4 build of torch 2.5 that sees ``gpus`` (a count of H100s, or the GPUs),
    with peer-to-peer access between all of them."""
    devices = gpus if isinstance(gpus, tuple) else tuple(torch_gpu(i) for i in range(gpus))
    n = len(devices)
    base = TorchInfo(
        version="2.5.1+cu124",
        build="cuda",
        cuda_runtime="12.4",
        cudnn_version=90100,
        nccl_version="2.21.5",
        nccl=True,
        cuda_available=n > 0,
        arch_list=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"),
        gpus=devices,
        p2p=tuple(tuple(True for _ in range(n)) for _ in range(n)) if n > 1 else (),
    )
    return replace(base, **kw)


def cpu_torch(**kw: Any) -> TorchInfo:
    return replace(TorchInfo(version="2.13.0+cpu", build="cpu"), **kw)


def spawn_plain_program(worker: Any, folder: str, nprocs: int) -> None:
    """Run the plain PyTorch reference program ``worker(rank, port, folder)`` on ``nprocs``
    processes as ``torch.multiprocessing.spawn`` runs it (``tests.ranks``). On a loaded 2-core
    machine gloo's C++ threads occasionally abort a rank of the reference itself ("terminate
    called without an active exception", SIGABRT) before any gpukit code runs; such a run is
    tried once more on a fresh port, and so is one whose port another process took between its
    choice here and the rank's bind. A second such end, or any other error, fails the test."""
    import socket

    from tests.ranks import PORT_TAKEN, RankFailed, start_processes

    for attempt in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            start_processes(worker, (port, folder), nprocs)
            return
        except RankFailed as err:
            if attempt or not (err.exit_code < 0 or err.exit_code == PORT_TAKEN):
                raise
