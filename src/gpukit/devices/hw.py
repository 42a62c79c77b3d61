"""What torch and the OS report about this machine's devices, behind small functions.

Everything else in gpukit asks here instead of calling ``torch.cuda`` directly, for two reasons:
a CPU-only build raises on most ``torch.cuda`` calls, and tests replace these functions to play a
machine with GPUs it does not have.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CudaProperties:
    """The facts of one CUDA device that gpukit shows."""

    name: str
    total_memory: int
    capability: tuple[int, int]
    uuid: str | None = None


def torch_build() -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"``: which accelerator this torch build was compiled for."""
    if torch.version.hip:
        return "rocm"
    if torch.version.cuda:
        return "cuda"
    return "cpu"


def cuda_built() -> bool:
    """Whether torch was built with CUDA (or ROCm, which torch also calls ``cuda``)."""
    return torch_build() != "cpu"


def cuda_count() -> int:
    """How many CUDA devices torch sees (after ``CUDA_VISIBLE_DEVICES``); 0 on a CPU build."""
    if not cuda_built():
        return 0
    return int(torch.cuda.device_count())


def cuda_properties(index: int) -> CudaProperties:
    """Name, memory and compute capability of CUDA device ``index``.

    Raises whatever torch raises when CUDA cannot start on that GPU (exclusive mode, ECC
    errors, no memory left for a context); callers decide how to report it.
    """
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return CudaProperties(
        name=str(props.name),
        total_memory=int(props.total_memory),
        capability=(int(props.major), int(props.minor)),
        uuid=f"GPU-{uuid}" if uuid is not None else None,
    )


def cuda_current() -> int:
    """The current CUDA device's index (what a bare ``"cuda"`` means to torch); 0 when CUDA
    cannot start, so that the caller reports the failure on a concrete device."""
    if not cuda_count():
        return 0
    try:
        return int(torch.cuda.current_device())
    except Exception:
        return 0


def cuda_device_scope(index: int) -> contextlib.AbstractContextManager[object]:
    """A context manager that makes ``index`` the current CUDA device."""
    return torch.cuda.device(index)


def mps_built() -> bool:
    """Whether this torch build has Apple's Metal (MPS) backend."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_built())


def mps_available() -> bool:
    """Whether MPS is usable now (built, on macOS 12.3 or later, with a Metal GPU)."""
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


@functools.cache
def cpu_name() -> str:
    """The processor's model name, as the OS describes it."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def _meminfo() -> Iterator[tuple[str, int]]:
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                # /proc/meminfo counts in KiB whatever its unit column says.
                yield key, int(parts[0]) * 1024


@functools.cache
def ram_total() -> int | None:
    """Physical memory in bytes, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def ram_available() -> int | None:
    """Memory available to new programs in bytes (Linux ``MemAvailable``), or None."""
    return dict(_meminfo()).get("MemAvailable")


def cpu_cores() -> tuple[int, int]:
    """(logical cores of the machine, cores this process may run on)."""
    total = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = total
    return total, usable
