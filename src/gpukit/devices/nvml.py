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
            handle = optional(nvml.nvmlDeviceGetHandleByIndex, index)
            uuid = (
                as_text(optional(nvml.nvmlDeviceGetUUID, handle) or "")
                if handle is not None
                else ""
            )
            if uuid in wanted:
                memory = optional(nvml.nvmlDeviceGetMemoryInfo, handle)
                free = int(memory.free) if memory is not None else None
                found[uuid] = (free, _other_processes(nvml, handle, os.getpid()))
        return found
    except Exception:
        return {}
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


# Bandwidth of one PCIe lane in each direction, GB/s (1e9 bytes/s), after line encoding
# (8b/10b up to gen2, 128b/130b from gen3; gen6's FLIT mode counted at its raw 64 GT/s).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}


@dataclass(frozen=True)
class PcieLink:
    """A GPU's PCIe link to the host: generation and lane count, now and at most.

    ``max_generation``/``max_width`` are what this GPU in this slot can reach (NVML's "max
    link", which already accounts for the slot and the CPU); the current ones drop while the
    GPU idles, to save power, so the peak is taken from the maximum.

    >>> link = PcieLink(generation=1, max_generation=4, width=16, max_width=16)
    >>> round(link.peak_bps() / 1e9, 1), link.describe()
    (31.5, 'PCIe gen4 x16 (now gen1 x16)')
    """

    generation: int | None
    max_generation: int | None
    width: int | None
    max_width: int | None

    def peak_bps(self) -> float | None:
        """Bytes per second in one direction at the link's best (its maximum generation and
        width; the current ones where NVML gives no maximum); None when unknown."""
        generation = self.max_generation or self.generation
        width = self.max_width or self.width
        if generation not in PCIE_LANE_GBPS or not width:
            return None
        return PCIE_LANE_GBPS[generation] * 1e9 * width

    def describe(self) -> str:
        """``PCIe gen4 x16``, and the current state where it differs from the best."""
        best = f"PCIe gen{self.max_generation or self.generation or '?'} "
        best += f"x{self.max_width or self.width or '?'}"
        now, most = (self.generation, self.width), (self.max_generation, self.max_width)
        if None in now or None in most or now == most:
            return best
        return f"{best} (now gen{self.generation} x{self.width})"


def pcie_link(gpu: str) -> PcieLink | None:
    """The PCIe link of the GPU whose UUID (``GPU-...``, as ``hw.cuda_properties`` gives it)
    or PCI bus id (``0000:3b:00.0``, any domain width) is ``gpu``; None without NVML, for a
    GPU NVML does not list, or when NVML knows nothing of its link. Never raises.

    Matched by UUID or bus id, never by index: NVML numbers every GPU of the machine in PCI
    order, CUDA only the visible ones, fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        for index in range(int(nvml.nvmlDeviceGetCount())):
            handle = optional(nvml.nvmlDeviceGetHandleByIndex, index)
            if handle is None or not _is_gpu(nvml, handle, gpu):
                continue
            link = PcieLink(
                generation=_int(optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)),
                max_generation=_int(optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle)),
                width=_int(optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)),
                max_width=_int(optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle)),
            )
            return None if link == PcieLink(None, None, None, None) else link
        return None
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _is_gpu(nvml: Any, handle: Any, gpu: str) -> bool:
    if gpu.startswith("GPU-") or gpu.startswith("MIG-"):
        return as_text(optional(nvml.nvmlDeviceGetUUID, handle) or "") == gpu
    pci = optional(nvml.nvmlDeviceGetPciInfo, handle)
    bus = _bus_id(as_text(getattr(pci, "busId", "") or ""))
    return bus is not None and bus == _bus_id(gpu)


def _bus_id(text: str) -> tuple[int, int, int, int] | None:
    """``domain:bus:device.function`` as numbers, so ``00000000:3B:00.0`` (NVML) and
    ``0000:3b:00.0`` (sysfs, nvidia-smi) compare equal.

    >>> _bus_id("00000000:3B:00.0") == _bus_id("0000:3b:00.0"), _bus_id("nonsense")
    (True, None)
    """
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return int(domain, 16), int(bus, 16), int(device, 16), int(function, 16)
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    """A positive count from NVML, None for none (0 or missing)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _other_processes(nvml: Any, handle: Any, own_pid: int) -> int | None:
    compute = optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    if compute is None:
        return None
    # Compute-only GPUs may not support the graphics query: they run no graphics processes.
    graphics = optional(nvml.nvmlDeviceGetGraphicsRunningProcesses, handle) or []
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
    driver = as_text(nvml.nvmlSystemGetDriverVersion())
    cuda = optional(nvml.nvmlSystemGetCudaDriverVersion)
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
    memory = optional(nvml.nvmlDeviceGetMemoryInfo, handle)
    util = optional(nvml.nvmlDeviceGetUtilizationRates, handle)
    capability = optional(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    pci = optional(nvml.nvmlDeviceGetPciInfo, handle)
    return NvmlGpu(
        index=index,
        name=as_text(nvml.nvmlDeviceGetName(handle)),
        uuid=as_text(optional(nvml.nvmlDeviceGetUUID, handle) or ""),
        pci_bus_id=as_text(getattr(pci, "busId", "") or ""),
        memory_total=int(memory.total) if memory is not None else None,
        memory_used=int(memory.used) if memory is not None else None,
        memory_free=int(memory.free) if memory is not None else None,
        utilization=int(util.gpu) if util is not None else None,
        capability=(int(capability[0]), int(capability[1])) if capability else None,
    )


def optional(call: Callable[..., T], *args: Any) -> T | None:
    """``call(*args)``, or None where NVML refuses it: some queries are unsupported on some
    GPUs (NVML_ERROR_NOT_SUPPORTED)."""
    try:
        return call(*args)
    except Exception:
        return None


def as_text(value: Any) -> str:
    """An NVML string (bytes in older bindings) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _describe(err: Exception) -> tuple[str, Absence]:
    text = str(err) or type(err).__name__
    if "LibraryNotFound" in type(err).__name__ or "Library Not Found" in text:
        return "libnvidia-ml.so not found: no NVIDIA driver is installed", "no-driver"
    if "DriverNotLoaded" in type(err).__name__ or "Driver Not Loaded" in text:
        return "the NVIDIA kernel driver is not loaded", "no-driver"
    return text, "error"
