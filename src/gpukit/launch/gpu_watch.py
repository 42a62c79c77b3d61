"""What NVML says of each rank's GPU while a job runs: the launcher's readings for ``gpukit
top`` and for the words beside a straggler.

A rank writes the CUDA index of its device in its beat (its own numbering, within the
``CUDA_VISIBLE_DEVICES`` the launcher gave it); the watch maps it through that variable to the
GPU NVML knows (an index, a ``GPU-`` UUID, or a ``MIG-`` one) and reads its utilisation, power
and limit, temperature, SM clock and its maximum, the reasons its clocks are held back, and
the processes on it that are not the job's (unknown where NVML's pids are not the launcher's:
in a container). NVML is initialised once for each attempt's watch;
readings are taken at most once a second. NVML missing or refusing is a note to show, never an
exception: the job runs the same without it.

>>> watch = GpuWatch(visible="2,3", nvml=None)
>>> watch.nvml_index(1)
'3'
>>> reading, note = watch.read(1, pids=set(), now=0.0)
>>> reading is None and note.startswith("NVML")
True
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from gpukit.devices.nvml import as_text, optional

EVERY_S = 1.0  # NVML is asked at most this often
# The clocks' event reasons NVML reports (nvmlClocksEventReason* bits), in words; the GPU
# being idle is no reason a rank is slow, and is left out.
THROTTLE_REASONS = {
    0x2: "applications clocks setting",
    0x4: "power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "thermal",
    0x40: "hardware thermal",
    0x80: "power brake",
    0x100: "display clocks setting",
}
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_CLOCK_SM = 1  # NVML_CLOCK_SM
_MISSING = object()


def throttle_words(mask: int) -> list[str]:
    """The reasons in NVML's bit mask, in words.

    >>> throttle_words(0x4 | 0x20 | 0x1)
    ['power cap', 'thermal']
    """
    return [word for bit, word in THROTTLE_REASONS.items() if mask & bit]


class GpuWatch:
    """The launcher's NVML readings of its ranks' GPUs (see the module docstring).
    ``visible``: the ``CUDA_VISIBLE_DEVICES`` the ranks were given (None: all); ``nvml``: the
    pynvml module (tests pass a fake; the default imports it, None means absent)."""

    def __init__(self, visible: str | None, nvml: Any = _MISSING) -> None:
        self.visible = [v.strip() for v in visible.split(",")] if visible else None
        self._nvml: Any = None
        self.note = ""
        self._readings: dict[int, tuple[dict[str, Any] | None, str]] = {}
        self._read_at: dict[int, float] = {}
        self._opened = False
        self._module = nvml

    def nvml_index(self, device: int) -> str:
        """The name NVML knows the rank's ``device`` by: a visible entry, or the index."""
        if self.visible is None:
            return str(device)
        return self.visible[device] if 0 <= device < len(self.visible) else ""

    def read(self, device: int, pids: set[int], now: float) -> tuple[dict[str, Any] | None, str]:
        """The reading of the rank's ``device`` (None when there is none) and a note saying
        why not (empty when read). ``pids``: the job's processes, not counted as others."""
        if device < 0:
            return None, ""  # a rank on the CPU: nothing to read, nothing to say
        if now - self._read_at.get(device, -EVERY_S) < EVERY_S:
            return self._readings[device]
        self._read_at[device] = now
        found = self._read(device, pids)
        self._readings[device] = found
        return found

    def _read(self, device: int, pids: set[int]) -> tuple[dict[str, Any] | None, str]:
        nvml = self._open()
        if nvml is None:
            return None, self.note
        name = self.nvml_index(device)
        if not name:
            return None, (
                f"GPU {device}: not among CUDA_VISIBLE_DEVICES={','.join(self.visible or [])}"
            )
        try:
            if name.isdigit():
                handle = nvml.nvmlDeviceGetHandleByIndex(int(name))
            else:
                handle = nvml.nvmlDeviceGetHandleByUUID(name)
        except Exception as err:
            return None, f"NVML refused GPU {name}: {_said(err)}"
        return _reading(nvml, handle, device, pids), ""

    def _open(self) -> Any:
        if self._opened:
            return self._nvml
        self._opened = True
        module = self._module
        if module is _MISSING:
            try:
                module = importlib.import_module("pynvml")
            except ImportError:
                module = None
        if module is None:
            self.note = "NVML: not installed (pip install nvidia-ml-py): no GPU readings"
            return None
        try:
            module.nvmlInit()
        except Exception as err:
            self.note = f"NVML refused: {_said(err)}: no GPU readings"
            return None
        self._nvml = module
        return module

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
        self._nvml, self._opened = None, False


def _reading(nvml: Any, handle: Any, device: int, pids: set[int]) -> dict[str, Any]:
    """One GPU's figures; each query NVML does not support on it is None."""
    util = optional(nvml.nvmlDeviceGetUtilizationRates, handle)
    power = optional(nvml.nvmlDeviceGetPowerUsage, handle)  # milliwatts
    limit = optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    mask = optional(reasons, handle) if reasons is not None else None
    processes = optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    name = optional(nvml.nvmlDeviceGetName, handle)
    return {
        "index": device,
        "name": as_text(name) if name is not None else "",
        "util": int(util.gpu) if util is not None else None,
        "power_w": round(power / 1000, 1) if power is not None else None,
        "power_limit_w": round(limit / 1000, 1) if limit is not None else None,
        "temp_c": optional(nvml.nvmlDeviceGetTemperature, handle, _TEMPERATURE_GPU),
        "sm_clock_mhz": optional(nvml.nvmlDeviceGetClockInfo, handle, _CLOCK_SM),
        "max_sm_clock_mhz": optional(nvml.nvmlDeviceGetMaxClockInfo, handle, _CLOCK_SM),
        "throttle": throttle_words(int(mask)) if mask is not None else [],
        "other_processes": _others(processes, pids),
    }


def _others(processes: Any, pids: set[int]) -> int | None:
    """The processes on the GPU that are not the job's; None when NVML does not say, or when
    its list names none of the job's processes while it names some: NVML gives the pids of
    the machine's namespace, and a launcher in a container (its own pid namespace) would
    count the job's own ranks as others."""
    if processes is None:
        return None
    found = {int(p.pid) for p in processes}
    if pids and found and not found & pids:
        return None
    return len(found - pids)


def _said(err: Exception) -> str:
    return str(err) or type(err).__name__
