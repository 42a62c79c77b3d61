"""GPU facts from NVML (the library behind nvidia-smi), read once into plain data.

NVML is optional: without the NVIDIA driver, or without the ``nvidia-ml-py`` package, ``read()``
returns an ``NvmlInfo`` with ``available=False`` and the reason, and callers fall back to what
torch reports. NVML sees every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` says, and
numbers them in PCI bus order.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")
# Why NVML gave nothing: the package or the driver is not there (normal without a GPU), or it
# is there and failed (a driver/library version mismatch after an upgrade, say).
Absence = Literal["no-package", "no-driver", "error"]


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU as NVML sees it; memory in bytes, utilisation in percent."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str = ""
    memory_total: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    utilization: int | None = None
    capability: tuple[int, int] | None = None
    error: str | None = None  # this GPU could not be read (e.g. "GPU is lost")


@dataclass(frozen=True)
class NvmlInfo:
    """What NVML says about the machine, or why it could not say."""

    available: bool
    error: str | None = None
    absence: Absence | None = None  # set when not available
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None  # the newest CUDA the driver supports
    gpus: tuple[NvmlGpu, ...] = field(default_factory=tuple)


def read() -> NvmlInfo:
    """Read the driver and every GPU from NVML; never raises."""
    try:
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return NvmlInfo(False, "the nvidia-ml-py package is not installed", "no-package")
    try:
        nvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return NvmlInfo(False, *_describe(err))
    try:
        return _read_initialised(nvml)
    except Exception as err:
        return NvmlInfo(False, f"NVML failed while reading: {_describe(err)[0]}", "error")
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def gpu_memory(uuids: Sequence[str]) -> dict[str, tuple[int | None, int | None]]:
    """Per GPU UUID ("GPU-..."): (free bytes, bytes used by other processes); never raises.

    GPUs are matched by UUID, never by index: NVML numbers every GPU of the machine, CUDA only
    the visible ones. "Other processes" sums NVML's compute and graphics processes whose pid
    is not ours; it is None where NVML cannot tell (unsupported query, or a process whose
    usage NVML hides). Inside a container NVML may report host pids, so this process can
    count as another one there. Without NVML the answer is ``{}``.
    """
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:
        return {}
    try:
        wanted, found = set(uuids), {}
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = _optional(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = (
                _text(_optional(nvml.nvmlDeviceGetUUID, handle) or "") if handle is not None else ""
            )
            if uuid in wanted:
                memory = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
                free = int(memory.free) if memory is not None else None
                found[uuid] = (free, _other_processes(nvml, handle, os.getpid()))
        return found
    except Exception:
        return {}
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _other_processes(nvml: Any, handle: Any, own_pid: int) -> int | None:
    compute = _optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    if compute is None:
        return None
    # Compute-only GPUs may not support the graphics query: they run no graphics processes.
    graphics = _optional(nvml.nvmlDeviceGetGraphicsRunningProcesses, handle) or []
    used: dict[int, int | None] = {}
    for proc in [*compute, *graphics]:
        if int(proc.pid) == own_pid:
            continue
        # A process with both contexts is listed twice with the same total: count it once.
        value = getattr(proc, "usedGpuMemory", None)
        known = used.get(int(proc.pid), 0)
        used[int(proc.pid)] = None if value is None or known is None else max(known, int(value))
    if any(v is None for v in used.values()):
        return None  # a partial sum would understate what the others hold
    return sum(v for v in used.values() if v is not None)


def _read_initialised(nvml: Any) -> NvmlInfo:
    driver = _text(nvml.nvmlSystemGetDriverVersion())
    cuda = _optional(nvml.nvmlSystemGetCudaDriverVersion)
    gpus = tuple(_read_gpu_or_error(nvml, i) for i in range(int(nvml.nvmlDeviceGetCount())))
    return NvmlInfo(
        available=True,
        driver_version=driver,
        cuda_driver_version=(cuda // 1000, (cuda % 1000) // 10) if cuda else None,
        gpus=gpus,
    )


def _read_gpu_or_error(nvml: Any, index: int) -> NvmlGpu:
    """One lost GPU must not hide the driver and the other GPUs."""
    try:
        return _read_gpu(nvml, index)
    except Exception as err:
        return NvmlGpu(index, "(unreadable)", "", error=_describe(err)[0])


def _read_gpu(nvml: Any, index: int) -> NvmlGpu:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
    util = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
    capability = _optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    pci = _optional(nvml.nvmlDeviceGetPciInfo, handle)
    return NvmlGpu(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(_optional(nvml.nvmlDeviceGetUUID, handle) or ""),
        pci_bus_id=_text(getattr(pci, "busId", "") or ""),
        memory_total=int(memory.total) if memory is not None else None,
        memory_used=int(memory.used) if memory is not None else None,
        memory_free=int(memory.free) if memory is not None else None,
        utilization=int(util.gpu) if util is not None else None,
        capability=(int(capability[0]), int(capability[1])) if capability else None,
    )


def _optional(call: Callable[..., T], *args: Any) -> T | None:
    """Some queries are unsupported on some GPUs (NVML_ERROR_NOT_SUPPORTED): None then."""
    try:
        return call(*args)
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(err: Exception) -> tuple[str, Absence]:
    text = str(err) or type(err).__name__
    if "LibraryNotFound" in type(err).__name__ or "Library Not Found" in text:
        return "libnvidia-ml.so not found: no NVIDIA driver is installed", "no-driver"
    if "DriverNotLoaded" in type(err).__name__ or "Driver Not Loaded" in text:
        return "the NVIDIA kernel driver is not loaded", "no-driver"
    return text, "error"
