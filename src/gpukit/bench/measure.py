"""How the experiments time one piece of work on one device: warm up, synchronise, repeat,
rotate the inputs, and summarise as a median with its spread.

- **Warm-up**: the first calls pay for lazy initialisation (CUDA context, cuBLAS handles and
  heuristics, allocator growth, the CPU's thread pool); they are run and thrown away.
- **Synchronised clocks**: a GPU call returns before its work is done. On a CUDA device the
  work is timed with CUDA events recorded on the current stream around it, and the host waits
  for the end event before reading the elapsed time (``clock="events"``); work spread over
  several streams or devices is timed with the host clock between two full synchronisations
  (``clock="host"``). On the CPU every op has finished when it returns.
- **Rotated inputs**: each repeat takes the next input of a pool, so a small problem is not
  served from a cache that a real program would have filled with something else.
- **Repeats**: at least ``min_repeats``, then more up to ``repeats`` while the time spent stays
  under ``budget_s`` (an 8192-square product on a 2-core CPU takes seconds; one on a GPU takes
  milliseconds, and both deserve a median).

>>> s = measure(lambda x: x + 1, torch.device("cpu"), inputs=[torch.zeros(4)] * 2, repeats=5)
>>> s.n, s.median >= 0, s.low <= s.median <= s.high
(5, True, True)
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpukit.bench.timing import check_count
from gpukit.devices import hw as _hw
from gpukit.errors import ConfigError

Clock = Literal["events", "host"]


@dataclass(frozen=True)
class Stats:
    """Seconds of the repeats: the median and the spread around it.

    ``low``/``high`` are the fastest and slowest repeat, ``q1``/``q3`` the quartiles; ``raw``
    keeps every repeat in the order they ran.

    >>> s = stats([3.0, 1.0, 2.0, 10.0])
    >>> s.median, s.low, s.high, s.n
    (2.5, 1.0, 10.0, 4)
    """

    median: float
    low: float
    high: float
    q1: float
    q3: float
    n: int
    raw: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the summary and the raw repeats."""
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "q1": self.q1,
            "q3": self.q3,
            "n": self.n,
            "raw": list(self.raw),
        }

    def spread(self) -> float:
        """The interquartile range relative to the median (0.05: the middle half of the repeats
        lies within 5% of the median's size).

        >>> round(stats([1.0, 1.0, 1.1, 1.1]).spread(), 3)
        0.095
        """
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0


def stats(values: Sequence[float]) -> Stats:
    """The :class:`Stats` of ``values`` (at least one).

    >>> stats([5.0]).q1, stats([5.0]).q3
    (5.0, 5.0)
    """
    if not values:
        raise ValueError("stats of no values")
    ordered = sorted(values)
    if len(ordered) > 1:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return Stats(
        median=statistics.median(ordered),
        low=ordered[0],
        high=ordered[-1],
        q1=q1,
        q3=q3,
        n=len(ordered),
        raw=tuple(values),
    )


def measure(
    work: Callable[[Any], object],
    device: torch.device | Sequence[torch.device],
    *,
    inputs: Sequence[Any] = (None,),
    repeats: int = 20,
    min_repeats: int = 3,
    warmup: int = 2,
    budget_s: float = 2.0,
    clock: Clock = "events",
) -> Stats:
    """Seconds one call of ``work(input)`` takes on ``device`` (or on several devices, whose
    work is then timed with the host clock between synchronisations of all of them).

    ``inputs`` is the pool the repeats rotate through. ``clock="events"`` times a CUDA
    device's current stream with CUDA events; ``"host"`` reads the host clock after
    synchronising every device (use it for work on several streams or devices, or work that
    waits on the host itself).

    >>> measure(lambda _: None, torch.device("cpu"), repeats=3, warmup=0).n
    3
    """
    check_count("repeats", repeats, "timed calls at most")
    check_count("min_repeats", min_repeats, "timed calls at least")
    if not inputs:
        raise ValueError("measure needs at least one input (None for work that takes none)")
    devices = [device] if isinstance(device, torch.device) else list(device)
    one_cuda = len(devices) == 1 and devices[0].type == "cuda"
    timer = _events_timer(devices[0]) if one_cuda and clock == "events" else _host_timer(devices)
    pool = list(inputs)
    for i in range(warmup):
        work(pool[i % len(pool)])
    sync_all(devices)
    seconds: list[float] = []
    spent, i = 0.0, 0
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()  # one variant's garbage must not be collected on another's clock
    try:
        while len(seconds) < repeats and (len(seconds) < min_repeats or spent < budget_s):
            taken = timer(work, pool[i % len(pool)])
            seconds.append(taken)
            spent += taken
            i += 1
    finally:
        if enabled:
            gc.enable()
    return stats(seconds)


def sync_all(devices: Sequence[torch.device]) -> None:
    """Wait until every queued op of every device (all its streams) has finished."""
    for dev in devices:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elif dev.type == "mps":
            torch.mps.synchronize()


def _host_timer(devices: Sequence[torch.device]) -> Callable[[Callable[[Any], object], Any], float]:
    def timed(work: Callable[[Any], object], arg: Any) -> float:
        sync_all(devices)
        start = time.perf_counter()
        work(arg)
        sync_all(devices)
        return time.perf_counter() - start

    return timed


def _events_timer(device: torch.device) -> Callable[[Callable[[Any], object], Any], float]:
    def timed(work: Callable[[Any], object], arg: Any) -> float:
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            work(arg)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # milliseconds

    return timed


def bench_devices(cpu: bool = True) -> list[torch.device]:
    """The devices an experiment runs on: the CPU (unless ``cpu=False``) and every visible
    CUDA GPU, in index order.

    >>> bench_devices()[0]
    device(type='cpu')
    """
    found = [torch.device("cpu")] if cpu else []
    if torch.cuda.is_available():
        found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return found


def device_name(device: torch.device) -> str:
    """What to call ``device`` in a table: ``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``.

    >>> device_name(torch.device("cpu"))
    'cpu'
    """
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def check_devices(
    devices: Sequence[torch.device | str] | None, experiment: str
) -> list[torch.device]:
    """``devices`` as torch devices this machine has (default: :func:`bench_devices`),
    without repeats; ConfigError naming what exists for any other.

    >>> check_devices([torch.device("cpu"), "cpu"], "demo")
    [device(type='cpu')]
    >>> check_devices(["tpu:0"], "demo")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: demo: no device 'tpu:0' here: this machine has cpu...
    """
    present = bench_devices()
    if devices is None:
        return present
    names = ", ".join(str(d) for d in present)
    if isinstance(devices, (str, torch.device)):
        raise ConfigError(
            f"{experiment}: devices={devices!r}: give a list of devices, e.g. "
            f"[torch.device('cpu')], or leave it out to use them all ({names})"
        )
    chosen: list[torch.device] = []
    for given in devices:
        dev = _as_device(given)
        if dev not in present:
            raise ConfigError(
                f"{experiment}: no device {str(given)!r} here: this machine has {names} "
                "(give some of them, or no devices to run on all of them)"
            )
        if dev not in chosen:
            chosen.append(dev)
    if not chosen:
        raise ConfigError(f"{experiment}: no devices given: give some of {names}, or None for all")
    return chosen


def _as_device(given: object) -> torch.device | None:
    try:
        dev = torch.device(given)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):
        return None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", _hw.cuda_current())
    return dev


def tf32_matmul() -> bool | None:
    """Whether float32 matrix products may run as TF32 on the tensor cores, read through the
    newer setting first (torch 2.9+: ``fp32_precision``), else the older ``allow_tf32``; None
    when torch refuses to read it (a process that mixed the two ways of setting it).

    >>> tf32_matmul() in (True, False, None)
    True
    """
    matmul = torch.backends.cuda.matmul
    newer = getattr(matmul, "fp32_precision", None)
    if newer in ("tf32", "ieee"):
        return newer == "tf32"
    try:
        return bool(matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return None
