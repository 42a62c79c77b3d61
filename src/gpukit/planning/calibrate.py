"""Measure the device this process sees, so that a plan's constants become measurements:
seconds per sample and fixed seconds per step (replacing the assumed efficiency and host
overhead), the peak of tensors at two micro-batch sizes, the caching allocator's reserve and
the CUDA context.

A step's time is close to linear in the micro-batch, ``t(b) = fixed + per_sample x b``: two
sizes fit the line. Each size trains a copy of the model (the caller's stays untouched) with
AdamW through a single-device Runtime, as ``gpukit train`` does; two warm-up steps build the
optimizer's state, one more is measured for memory, then ``steps`` are timed with the device
synchronised before each clock read (:func:`gpukit.devices.clock.time_once`), each
timed sample the mean of a block of :data:`BLOCK` consecutive steps, and their median kept.

>>> cal = calibrate("mlp", micro_batches=(8, 1024), steps=1, device="cpu")
>>> cal.step_seconds[0] > 0, cal.measured_peak_tensors[0] < cal.measured_peak_tensors[1]
(True, True)
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit._util.text import format_bytes
from gpukit._util.tree import tensors
from gpukit.devices import hw
from gpukit.devices.clock import synchronizer, time_once
from gpukit.devices.move import to
from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.errors import ConfigError
from gpukit.planning.registered import one_device
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import Workload, load_workload

# Seconds one step takes: given the step to run and its micro-batch. The default runs it once
# with time_once; tests pass synthetic times.
Timer = Callable[[Callable[[], object], int], float]


@dataclass(frozen=True)
class Line:
    """One configuration's measured step time: ``strategy`` on ``devices`` devices at each of
    two micro-batches per device, and the line through them (``fixed_seconds`` +
    ``seconds_per_sample`` x micro-batch)."""

    strategy: str
    devices: int
    micro_batches: tuple[int, int]
    step_seconds: tuple[float, float]
    fixed_seconds: float
    seconds_per_sample: float

    def at(self, micro_batch: int) -> float:
        """Seconds of one step at ``micro_batch`` samples per device."""
        return self.fixed_seconds + self.seconds_per_sample * micro_batch


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured on ``device`` (its name: ``device_name``) in
    ``precision``: ``step_seconds[i]`` is the median step time at ``micro_batches[i]``,
    ``measured_peak_tensors[i]`` the peak bytes of tensors then."""

    device: str
    device_name: str
    precision: str
    micro_batches: tuple[int, int]
    step_seconds: tuple[float, float]
    seconds_per_sample: float
    fixed_seconds: float
    measured_peak_tensors: tuple[int, int]
    reserve_fraction: float
    context_bytes: int
    # Step-time lines measured for a strategy on several devices here
    # (gpukit.planning.calibrate_runs); the single-device one is built from the fields above.
    lines: tuple[Line, ...] = ()

    def line(self, strategy: str, devices: int) -> Line | None:
        """The line measured for ``strategy`` on ``devices`` devices, None if not measured
        (single on one device: always measured)."""
        alone = one_device()
        if strategy == alone and devices == 1:
            return Line(
                alone,
                1,
                self.micro_batches,
                self.step_seconds,
                self.fixed_seconds,
                self.seconds_per_sample,
            )
        return next((x for x in self.lines if (x.strategy, x.devices) == (strategy, devices)), None)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through ``(x, y)`` points: with two
    points, the line through them. The slope is kept at 0 or more and the intercept too: a
    step does not get faster with more samples, and timing noise must not say it does.

    >>> fit_line([(8, 0.03), (16, 0.05)])
    (0.01, 0.0025)
    """
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(xs)) < 2:
        raise ConfigError(f"micro-batches {xs}: fitting a line needs two different sizes")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    slope = max(slope, 0.0)
    intercept = max(my - slope * mx, 0.0)
    return round(intercept, 15), round(slope, 15)


def reserve_fraction(max_allocated: int, max_reserved: int) -> float:
    """What the caching allocator reserved above the tensors' peak, as a share of that peak.

    >>> reserve_fraction(1000, 1100)
    0.1
    """
    return max(max_reserved - max_allocated, 0) / max_allocated if max_allocated > 0 else 0.0


def cuda_context_bytes(device: torch.device) -> int:
    """What the driver holds on ``device`` beside torch's reserve: total - free - reserved.

    Read right after the first CUDA use it is this process's context; later it also counts
    other processes on the GPU (free memory is the device's, not the process's).
    """
    free, total = torch.cuda.mem_get_info(device)
    return max(int(total) - int(free) - int(torch.cuda.memory_reserved(device)), 0)


def cuda_peaks(device: torch.device, step: Callable[[], object]) -> tuple[int, int]:
    """(max allocated, max reserved) bytes on ``device`` while ``step()`` runs."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device)), int(torch.cuda.max_memory_reserved(device))


def calibrate(
    workload: Workload | str | nn.Module,
    *,
    micro_batches: tuple[int, int] = (8, 32),
    steps: int = 3,
    device: str | torch.device | None = None,
    precision: str = "auto",
    dataset: Any = None,
    loss: Callable[[Any, Any], torch.Tensor] | None = None,
    lr: float = 1e-3,
    timer: Timer | None = None,
) -> Calibration:
    """Measure training ``workload`` (a :class:`~gpukit.workloads.base.Workload`, a built-in
    name, or a model with ``dataset`` and ``loss``) on ``device`` (None: the best one) at
    each of two ``micro_batches`` (see the module doc).

    >>> cal = calibrate("mlp", micro_batches=(4, 8), steps=1, device="cpu",
    ...                 timer=lambda run, b: 0.01 + 0.002 * b)
    >>> cal.fixed_seconds, cal.seconds_per_sample, cal.reserve_fraction, cal.context_bytes
    (0.01, 0.002, 0.0, 0)
    """
    model, data, criterion, lr = _parts(workload, dataset, loss, lr)
    check_fits_here(model, device)
    sizes = tuple(micro_batches)
    if (
        len(sizes) != 2
        or len(set(sizes)) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes)
    ):
        raise ConfigError(
            f"micro_batches={micro_batches!r}: give two different whole numbers of at least 1, "
            "such as (8, 32)"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps={steps!r}: give a whole number of at least 1 (timed steps)")
    context = None
    seconds: list[float] = []
    peaks: list[int] = []
    fractions: list[float] = []
    name = where = used = ""
    for b in sizes:
        rt = Runtime(strategy=one_device(), devices=device or "auto", precision=precision)
        dev = rt.strategy.device.torch
        if context is None:  # first: before this run puts tensors on the device
            context = cuda_context_bytes(dev) if dev.type == "cuda" else 0
        try:
            step = _stepper(rt, copy.deepcopy(model), data, criterion, lr, b)
            step()  # warm-up: lazy initialisation, the optimizer's state
            step()
            if dev.type == "cuda":
                allocated, reserved = cuda_peaks(dev, step)
                fractions.append(reserve_fraction(allocated, reserved))
            else:
                allocated = _counted_peak(step, dev)
                fractions.append(0.0)
            peaks.append(allocated)
            step.fresh()  # the loader's workers and first batch
            seconds.append(_median_time(step.fresh, b, steps, timer or _default_timer(dev)))
            where, used = _name(dev), rt.precision.name
            name = _device_name(dev)
        finally:
            rt.teardown()
    fixed, per_sample = fit_line(list(zip(sizes, seconds, strict=True)))
    return Calibration(
        device=where,
        device_name=name,
        precision=used,
        micro_batches=(sizes[0], sizes[1]),
        step_seconds=(seconds[0], seconds[1]),
        seconds_per_sample=per_sample,
        fixed_seconds=fixed,
        measured_peak_tensors=(peaks[0], peaks[1]),
        reserve_fraction=max(fractions),
        context_bytes=context or 0,
    )


# Bytes per parameter that training with AdamW holds at least: float32 weights, gradients and
# the optimizer's two moments.
TRAINING_BYTES_PER_PARAMETER = 16
# Share of the device's memory that state may take for a calibration to go ahead: activations,
# the batch and the allocator need the rest.
HEADROOM = 0.5


def check_fits_here(model: nn.Module, device: str | torch.device | None) -> None:
    """Refuse, before anything is allocated, a model whose weights, gradients and AdamW state
    alone exceed :data:`HEADROOM` of the memory of ``device`` on this machine (a meta-device
    model of billions of parameters): calibration trains it for real."""
    params = sum(p.numel() for p in model.parameters())
    need = params * TRAINING_BYTES_PER_PARAMETER
    kind = (
        torch.device(device).type
        if device not in (None, "auto")
        else ("cuda" if hw.cuda_count() else "cpu")
    )
    have = hw.cuda_properties(0).total_memory if kind == "cuda" else hw.ram_total()
    if have and need > have * HEADROOM:
        raise ConfigError(
            f"calibrate: the model has {params:,} parameters; training them here holds at "
            f"least {format_bytes(need)} (float32 weights, gradients and AdamW's two moments), "
            f"more than {HEADROOM:.0%} of this machine's {kind} memory ({format_bytes(have)}; "
            "the rest is for activations): it is too large to calibrate here. Calibrate on a "
            "machine where it trains, or plan without calibration (the step time is then a "
            "datasheet estimate)"
        )


def _parts(
    workload: Workload | str | nn.Module,
    dataset: Any,
    loss: Callable[[Any, Any], torch.Tensor] | None,
    lr: float,
) -> tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor], float]:
    if isinstance(workload, str):
        workload = load_workload(workload, meta=True)  # a meta model: materialised by setup
    if isinstance(workload, Workload):
        return workload.model, workload.dataset, workload.loss, workload.lr
    if isinstance(workload, nn.Module):
        if dataset is None or loss is None:
            raise ConfigError(
                "calibrate(model) needs dataset= (items: (input, target) pairs) and loss= "
                "(loss(model(inputs), targets)), or give a Workload or a workload name"
            )
        return workload, dataset, loss, lr
    raise ConfigError(
        f"calibrate({type(workload).__name__}): give a Workload, a workload name such as "
        "'mlp', or an nn.Module with dataset= and loss="
    )


class _Step:
    """One optimizer step through ``rt``: of a fixed batch (``step()``, for memory), or of the
    next batch drawn as ``gpukit train`` draws them, shuffled and collated, its loss logged
    (``step.fresh()``, for time: the loader's cost per sample is part of a step's)."""

    def __init__(
        self,
        rt: Runtime,
        model: nn.Module,
        batch: Any,
        criterion: Any,
        lr: float,
        fresh: Iterator[Any] | None = None,
    ) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.model, self.optimizer = rt.setup(model, optimizer)
        self.criterion = rt.setup_criterion(criterion)
        self.rt, self.batch = rt, to(batch, rt.strategy.device.torch)
        self.batches = fresh

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.criterion(self.model(x), y)

    def __call__(self) -> None:
        self.rt.train_step(self.optimizer, self.batch, self.loss)

    def fresh(self) -> None:
        if self.batches is None:
            return self()
        batch = to(next(self.batches), self.rt.strategy.device.torch)
        self.rt.log(loss=self.rt.train_step(self.optimizer, batch, self.loss))
        return None


def batches(data: Any, size: int) -> Iterator[Any]:
    """Endless shuffled batches of ``size`` samples of ``data``, collated by a DataLoader."""
    sampler = torch.utils.data.RandomSampler(data, replacement=True, num_samples=size * 2**20)
    return iter(torch.utils.data.DataLoader(data, batch_size=size, sampler=sampler))


def _stepper(rt: Runtime, model: nn.Module, data: Any, criterion: Any, lr: float, b: int) -> _Step:
    n = len(data)
    if n < 1:
        raise ConfigError("calibrate: the dataset is empty; give one with at least one sample")
    batch = torch.utils.data.default_collate([data[i % n] for i in range(b)])
    return _Step(rt, model, batch, criterion, lr, batches(data, b))


def _counted_peak(step: _Step, device: torch.device) -> int:
    """The peak of live tensors over one step on a CPU (model, optimizer state and the batch,
    which exist before it, counted too)."""
    with LiveTensors() as live:
        live.watch(step.model, [step.optimizer])
        for t in tensors(step.batch):
            live.file(t, "activations")
        step()
    return live.peak.get(_name(device), 0)


# Steps timed together, their mean kept: one clock read (and one garbage collection before it)
# per block, as a training loop's clock spans its steps, rather than a cold start per step.
BLOCK = 5


def block_time(run: Callable[[], object], sync: Callable[[], None] | None) -> float:
    """Mean seconds of :data:`BLOCK` consecutive ``run()`` calls, timed together."""
    return time_once(lambda: [run() for _ in range(BLOCK)], sync) / BLOCK


def _default_timer(device: torch.device) -> Timer:
    sync = synchronizer(device)
    return lambda run, _b: block_time(run, sync)


def _median_time(step: Callable[[], object], b: int, steps: int, timer: Timer) -> float:
    return statistics.median(timer(step, b) for _ in range(steps))


def _name(device: torch.device) -> str:
    if device.type == "cpu" or device.index is not None:
        return str(device)
    return f"{device.type}:0"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return hw.cpu_name()


__all__ = [
    "BLOCK",
    "HEADROOM",
    "TRAINING_BYTES_PER_PARAMETER",
    "Calibration",
    "Line",
    "Timer",
    "batches",
    "block_time",
    "calibrate",
    "check_fits_here",
    "cuda_context_bytes",
    "cuda_peaks",
    "fit_line",
    "reserve_fraction",
]
