"""GPU utilisation while something runs: NVML's busy percentage of each GPU, sampled in a
background thread.

NVML's ``utilization.gpu`` is the share of time, over the GPU's last sample period (1/6 s to
1 s depending on the product), during which at least one kernel was running. It is a time
share, not a share of the GPU's compute: one small kernel kept running shows 100%. MFU says
how much of the compute peak the work uses; this says whether the GPU waited for the host.

NVML sees every process on a GPU, so a sampler in a parent process also covers the processes
a DDP launch starts. GPUs are matched to CUDA devices by UUID, never by index: NVML numbers
every GPU of the machine, CUDA only the visible ones. Sampling never raises and never stops
the work it watches: without NVML, or for a GPU NVML does not list, the figures are None and
``error`` says why.

>>> import torch
>>> with UtilizationSampler([torch.device("cpu")]) as util:  # nothing to sample on a CPU
...     pass
>>> util.stats(), util.error
({}, None)
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpukit.devices import hw as _hw

# Between samples: several per NVML sample period (so a short run still gets some), and
# rarely enough that the sampling thread costs the work it watches nothing measurable.
DEFAULT_INTERVAL = 0.075


@dataclass(frozen=True)
class UtilizationStats:
    """The samples of one GPU: mean and max busy percentage, and how many samples.

    >>> UtilizationStats("cuda:0", 87.5, 100.0, 12).to_dict()["mean"]
    87.5
    """

    device: str
    mean: float
    max: float
    samples: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields by name."""
        return {"device": self.device, "mean": self.mean, "max": self.max, "samples": self.samples}


class UtilizationSampler:
    """A context manager sampling NVML's utilisation of the CUDA devices among ``devices``
    every ``interval`` seconds, from entering until leaving.

    ``stats()`` gives each CUDA device's :class:`UtilizationStats` (None where nothing was
    sampled: no NVML, a GPU NVML does not list, or a query it does not support); non-CUDA
    devices are left out. ``error`` says why nothing was sampled, None when all went well.
    Samples carry ``time.time()`` stamps, comparable with the clocks of other processes on
    the machine, so ``stats(start, end)`` can keep the span another process reported.

    >>> import torch
    >>> sampler = UtilizationSampler([torch.device("cuda", 0)])
    >>> sampler.stats()  # before entering, or without NVML: nothing sampled
    {'cuda:0': None}
    """

    def __init__(self, devices: Sequence[torch.device], interval: float = DEFAULT_INTERVAL) -> None:
        self.interval = interval
        self.devices = [_name(d) for d in devices if d.type == "cuda"]
        self._indices = [_index(d) for d in devices if d.type == "cuda"]
        self.samples: dict[str, list[tuple[float, float]]] = {d: [] for d in self.devices}
        self.error: str | None = None
        self._nvml: Any = None
        self._handles: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilizationSampler:
        if not self.devices:
            return self
        try:
            self._start()
        except Exception as err:  # the run matters more than its utilisation figure
            self.error = f"NVML failed: {err}"
            self._handles = {}
            self._shutdown()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._handles:
            self._sample()  # NVML's last figure covers the run's last moments
        self._shutdown()

    def stats(
        self, start: float | None = None, end: float | None = None
    ) -> dict[str, UtilizationStats | None]:
        """Per CUDA device, the samples taken from ``start`` until one interval after ``end``
        (``time.time()`` values; None: no bound). NVML's figure describes the period before
        it is read, so the first sample after ``end`` still belongs to the span."""
        found: dict[str, UtilizationStats | None] = {}
        for name in self.devices:
            values = [
                v
                for t, v in self.samples[name]
                if (start is None or t >= start) and (end is None or t <= end + self.interval)
            ]
            found[name] = (
                UtilizationStats(name, sum(values) / len(values), max(values), len(values))
                if values
                else None
            )
        return found

    # -- NVML ----------------------------------------------------------------------------
    def _start(self) -> None:
        try:
            nvml: Any = importlib.import_module("pynvml")
        except ImportError:
            self.error = "the nvidia-ml-py package is not installed"
            return
        try:
            nvml.nvmlInit()
        except Exception as err:  # no driver, or a driver/library mismatch
            self.error = f"NVML did not start: {err}"
            return
        self._nvml = nvml
        by_uuid = {}
        for i in range(int(nvml.nvmlDeviceGetCount())):
            with contextlib.suppress(Exception):  # one lost GPU must not hide the others
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                by_uuid[_text(nvml.nvmlDeviceGetUUID(handle))] = handle
        missing = []
        for name, index in zip(self.devices, self._indices, strict=True):
            uuid = _uuid(index)
            if uuid is not None and uuid in by_uuid:
                self._handles[name] = by_uuid[uuid]
            else:
                missing.append(name)
        if missing:
            self.error = f"NVML lists no GPU with the UUID of {', '.join(missing)}"
        if not self._handles:
            return
        self._sample()  # one sample at once, so a run shorter than an interval has one
        self._thread = threading.Thread(target=self._loop, name="gpukit-utilization", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        now = time.time()
        for name, handle in self._handles.items():
            try:
                busy = float(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception as err:  # unsupported query or a lost GPU: keep the others going
                self.error = f"{name}: NVML utilisation query failed: {err}"
                continue
            self.samples[name].append((now, busy))

    def _shutdown(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()
            self._nvml = None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else _hw.cuda_current()


def _name(device: torch.device) -> str:
    return f"cuda:{_index(device)}"


def _uuid(index: int) -> str | None:
    try:
        return _hw.cuda_properties(index).uuid
    except Exception:  # CUDA cannot start on that GPU: it has no UUID to match
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
