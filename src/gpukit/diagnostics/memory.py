"""Memory per device: what this process (or every rank) holds, its peak, and what is left.

>>> from gpukit.diagnostics.memory import memory
>>> row = memory(["cpu"]).rows[0]
>>> row.device, row.allocated > 0, row.total is not None
('cpu', True, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rich.table import Table

from gpukit._util.text import (
    described,
    format_bytes,
    make_table,
    render_plain,
    safe_repr,
    type_name,
)
from gpukit.devices import hw as _hw
from gpukit.devices import nvml as _nvml
from gpukit.devices.device import Device, device
from gpukit.diagnostics.memory_breakdown import breakdown
from gpukit.errors import ConfigError

DeviceList = Sequence[str | int | torch.device | Device]
AR = ("allocated", "reserved")


@dataclass(frozen=True)
class DeviceMemory:
    """One device as seen by one process, in bytes (see :func:`report` for where each comes from).

    ``peak_tensors`` is the peak of what tensors alone held over a measured stretch (``gpukit
    train``'s first steps, see :mod:`gpukit.diagnostics.peak_tensors`): None where it was not
    measured.

    >>> DeviceMemory("cpu", None, 10, 10, 12, 100, 50, None).to_dict()["peak"]
    12
    """

    device: str
    rank: int | None
    allocated: int
    reserved: int
    peak: int
    total: int | None
    free: int | None
    other_processes: int | None
    peak_tensors: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields by name."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class MemoryReport:
    """Rows of :class:`DeviceMemory`, with the imbalance of their peaks.

    >>> gib = 1024**3
    >>> rows = [DeviceMemory(f"cuda:{i}", None, 0, 0, p * gib, None, None, None) for i, p in
    ...         enumerate([3, 1, 0])]
    >>> MemoryReport(tuple(rows)).imbalance  # the idle cuda:2 does not count
    3.0
    """

    rows: tuple[DeviceMemory, ...]

    @property
    def imbalance(self) -> float | None:
        """max/min peak over the rows that peaked above 0; None with fewer than 2 such rows."""
        peaks = [r.peak for r in self.rows if r.peak > 0]
        return max(peaks) / min(peaks) if len(peaks) >= 2 else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"devices": [row dicts], "imbalance": x or None}``."""
        return {"devices": [r.to_dict() for r in self.rows], "imbalance": self.imbalance}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """The report ``to_dict`` wrote (as read back from ``metrics.json``; files written
        before ``peak_tensors`` existed read as None there)."""
        return cls(tuple(DeviceMemory(**row) for row in data["devices"]))

    def table(self, title: str | None = "Memory per device") -> Table:
        """A rich table; the rank and "peak tensors" columns appear only when some row has
        a value there."""
        ranked = any(r.rank is not None for r in self.rows)
        measured = any(r.peak_tensors is not None for r in self.rows)
        header = ["device", *(["rank"] if ranked else [])]
        header += ["allocated", "reserved", "peak", *(["peak tensors"] if measured else [])]
        header += ["total", "free", "other processes"]
        rows = [
            [r.device, *([str(r.rank) if r.rank is not None else "-"] if ranked else [])]
            + [_bytes(v) for v in (r.allocated, r.reserved, r.peak)]
            + ([_bytes(r.peak_tensors)] if measured else [])
            + [_bytes(v) for v in (r.total, r.free, r.other_processes)]
            for r in self.rows
        ]
        return make_table(title, header, rows)

    def __str__(self) -> str:
        text = render_plain(self.table())
        ratio = self.imbalance
        return text if ratio is None else f"{text}\nimbalance (max/min peak): {ratio:.2f}x"


def report(devices: DeviceList | None = None, *, all_ranks: bool | None = None) -> MemoryReport:
    """Memory of ``devices`` (default: those this process uses), per device, in bytes.

    Without ``devices``: every CUDA device where torch's caching allocator holds or has held
    memory, else the single row ``cpu``. Reading them creates no CUDA context. ``devices`` takes
    any spelling :func:`gpukit.device` does (one, or a list). For CUDA, ``allocated``,
    ``reserved`` and ``peak`` come from the caching allocator; ``free`` is device-wide; and
    ``other_processes`` is what NVML sees other processes use there. For the CPU, allocated
    (and reserved) is the process's resident memory and ``peak`` its high-water mark.

    With ``all_ranks`` (default: when torch.distributed runs with more than one rank) every
    rank's rows are gathered with ``all_gather_object``: a collective, so **every rank must
    call it**, or the ones that do wait forever. Under NCCL, set each rank's current CUDA device
    first (``torch.cuda.set_device``), as the gather goes through it.

    >>> report("cpu").rows[0].device
    'cpu'
    """
    rank, world = _dist_state()
    if all_ranks is None:
        all_ranks = world > 1
    elif not isinstance(all_ranks, bool):
        raise ConfigError(f"all_ranks={described(all_ranks)}: pass True, False or None (automatic)")
    if all_ranks and rank is None:
        raise ConfigError(
            "all_ranks=True but torch.distributed is not initialised: call it from every rank "
            "after init_process_group (or gk.Runtime setup), or pass all_ranks=False"
        )
    targets = _resolve(devices)
    uuids = {
        d.index: getattr(_cuda_props(d.index), "uuid", None) for d in targets if d.type == "cuda"
    }
    nvml = _nvml.gpu_memory([u for u in uuids.values() if u]) if uuids else {}
    rows = tuple(
        _cuda_row(d.index, rank, nvml.get(uuids[d.index] or "", (None, None)))
        if d.type == "cuda"
        else _cpu_row(rank)
        for d in targets
    )
    if not all_ranks:
        return MemoryReport(rows)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    return MemoryReport(tuple(row for part in gathered for row in part))


def reset_peaks(devices: DeviceList | None = None) -> None:
    """Start the peaks of :func:`report` afresh (default: on the devices it lists).

    CUDA: the caching allocator's peak statistics. CPU: the high-water mark of resident
    memory, where Linux allows it (``/proc/self/clear_refs``); elsewhere it stays.

    >>> reset_peaks(["cpu"])
    """
    for d in _resolve(devices):
        if d.type == "cuda":
            _cuda_reset_peak(d.index)
        else:
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets VmHWM to the current RSS (proc(5))


class MemoryTool:
    """``gk.memory``: call it for a :func:`report`; it also has ``reset_peaks`` and
    ``breakdown``.

    >>> from gpukit.diagnostics.memory import memory
    >>> memory.reset_peaks(["cpu"]); memory(["cpu"]).rows[0].peak > 0
    True
    """

    report = staticmethod(report)
    reset_peaks = staticmethod(reset_peaks)
    breakdown = staticmethod(breakdown)

    def __call__(
        self, devices: DeviceList | None = None, *, all_ranks: bool | None = None
    ) -> MemoryReport:
        return report(devices, all_ranks=all_ranks)

    def __repr__(self) -> str:
        return "gk.memory"


memory = MemoryTool()


# -- where the numbers come from: small functions that tests replace ----------------------


def _cuda_stats(index: int) -> tuple[int, int, int, int]:
    """(allocated, reserved, peak allocated, peak reserved) from the caching allocator; zeros
    before CUDA starts, without starting it (the allocator's counters need no context)."""
    if not torch.cuda.is_initialized():
        return 0, 0, 0, 0
    s = torch.cuda.memory_stats(index)
    a, r, pa, pr = (int(s.get(f"{k}_bytes.all.{w}", 0)) for w in ("current", "peak") for k in AR)
    return a, r, pa, pr


def _cuda_mem_get_info(index: int) -> tuple[int, int]:
    """(free, total) device-wide; creates a CUDA context on an untouched GPU (~500 MB)."""
    return torch.cuda.mem_get_info(index)


def _cuda_reset_peak(index: int) -> None:
    if torch.cuda.is_initialized():  # before CUDA starts there is no peak to reset
        torch.cuda.reset_peak_memory_stats(index)


def _dist_state() -> tuple[int | None, int]:
    """(this process's rank or None, world size)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return None, 1


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM in bytes from /proc/self/status (Linux); {} elsewhere."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/status", encoding="utf-8") as f:
        for key, _, rest in (line.partition(":") for line in f):
            if key in ("VmRSS", "VmHWM") and rest.split():
                found[key] = int(rest.split()[0]) * 1024  # the kernel counts in KiB
    return found


def _max_rss() -> int:
    if sys.platform == "win32":
        return 0  # no resource module; /proc is missing too, so the row shows zeros
    import resource

    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024  # macOS says bytes, Linux KiB


def _cuda_props(index: int) -> _hw.CudaProperties | None:
    try:
        return _hw.cuda_properties(index)
    except Exception:  # CUDA cannot start there: no total, and nothing to ask NVML about
        return None


# -- rows ----------------------------------------------------------------------------------


def _resolve(devices: DeviceList | None) -> list[Device]:
    if devices is None:
        used = [i for i in range(_hw.cuda_count()) if _held(_cuda_stats(i))]
        return [Device("cuda", i) for i in used] or [Device("cpu")]
    if isinstance(devices, bool) or not isinstance(
        devices, (str, int, torch.device, Device, list, tuple)
    ):
        raise ConfigError(
            f"devices={safe_repr(devices)} ({type_name(devices)}) is not a device list: pass None "
            "(the devices in use), one device like 'cuda:0', or a list like ['cuda:0', 1]"
        )
    try:
        specs = list(devices) if isinstance(devices, (list, tuple)) else [devices]
    except Exception as err:  # a list whose own methods fail
        raise ConfigError(
            f"devices={described(devices)}: reading the list failed with "
            f"{type(err).__name__}: pass a plain list like ['cuda:0', 1]"
        ) from err
    if not specs:
        raise ConfigError("devices=[] names no device: pass None for the devices in use")
    resolved = list(dict.fromkeys(device(spec) for spec in specs))  # once each, in order
    other = [str(d) for d in resolved if d.type not in ("cpu", "cuda")]
    if other:
        raise ConfigError(f"no memory report for {', '.join(other)}: pass cpu or cuda devices")
    return resolved


def _held(stats: tuple[int, int, int, int]) -> bool:
    return stats[1] > 0 or stats[3] > 0  # reserved now, or at some point since the last reset


def _cuda_row(index: int, rank: int | None, nvml: tuple[int | None, int | None]) -> DeviceMemory:
    stats = _cuda_stats(index)
    props = _cuda_props(index)
    free, others = nvml
    if _held(stats):  # a context exists already, so asking CUDA costs nothing
        with contextlib.suppress(Exception):
            free = _cuda_mem_get_info(index)[0]
    total = props.total_memory if props else None
    return DeviceMemory(f"cuda:{index}", rank, *stats[:3], total, free, others)


def _cpu_row(rank: int | None) -> DeviceMemory:
    status = _proc_status()
    current = status.get("VmRSS") or _max_rss()  # without /proc the peak is the best we have
    peak = max(status.get("VmHWM") or _max_rss(), current)
    ram = _hw.ram_total(), _hw.ram_available()
    return DeviceMemory("cpu", rank, current, current, peak, *ram, None)


def _bytes(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)
