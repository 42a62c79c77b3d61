"""Calibrate the step time of the strategies and device counts a plan asks for, by training
each for a few steps here, as ``gpukit train`` would run it.

:func:`~gpukit.planning.calibrate.calibrate` measures one device (and the memory overheads);
a strategy on several devices adds what no single-device run shows: the collectives over
this machine's links (gloo between CPU processes, NCCL between GPUs), the copies of dp, and
the processes competing for the host's cores. So each (strategy, device count) the plan asks
for whose devices this machine has is measured too: the processes of ddp and fsdp are
started by ``rt.launch`` with one thread each unless ``OMP_NUM_THREADS`` says otherwise (as
``gpukit train`` starts them); dp and dp-balanced run in this process. Each trains the
workload at the plan's micro-batch per device and at half of it, and the line through the
two medians is kept (:class:`~gpukit.planning.calibrate.Line`). A count this machine does not
have is not measured: the planner extrapolates it from the one-device line and the modelled
collectives, and says so.

>>> cases_here([("single", 1), ("ddp", 2), ("ddp", 4096)], kind="cpu", available=2)
[('ddp', 2)]
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from gpukit.devices import hw
from gpukit.devices.clock import synchronizer
from gpukit.devices.move import to
from gpukit.errors import ConfigError
from gpukit.planning import registered
from gpukit.planning.calibrate import (
    Calibration,
    Line,
    batches,
    block_time,
    calibrate,
    check_fits_here,
    fit_line,
)
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import Workload, load_workload

WARMUP_STEPS = 3
# Seconds without progress after which a calibration run counts as hung (it is a few steps).
HANG_S = 120


def micro_sizes(micro_batch: int) -> tuple[int, int]:
    """The two micro-batches a line is measured at: the plan's and half of it (1 and 2 for a
    micro-batch of 1).

    >>> micro_sizes(32), micro_sizes(1)
    ((16, 32), (1, 2))
    """
    return (micro_batch // 2, micro_batch) if micro_batch > 1 else (1, 2)


def cases_here(
    cases: Sequence[tuple[str, int]], *, kind: str, available: int
) -> list[tuple[str, int]]:
    """The (strategy, device count) pairs of ``cases`` to measure beside the single-device
    calibration: strategies for several devices on several, at most ``available`` of
    ``kind``'s here (a CPU: its cores, each process its own)."""
    del kind
    return [
        (s, n)
        for s, n in dict.fromkeys(cases)
        if 1 < n <= available and s in registered.names() and registered.traits(s).max_devices != 1
    ]


def calibrate_plan(
    workload: str | Workload,
    cases: Sequence[tuple[str, int]],
    *,
    batch: int | None = None,
    accumulate: int = 1,
    steps: int = 5,
    device: str | None = None,
    precision: str = "auto",
) -> Calibration:
    """:func:`~gpukit.planning.calibrate.calibrate` on one device at the one-device plan's
    micro-batch, then a line for each of ``cases`` this machine has devices for (see the
    module doc). ``batch``: the global batch (default: the workload's)."""
    built = load_workload(workload, meta=True) if isinstance(workload, str) else workload
    if not isinstance(built, Workload):
        raise ConfigError(
            f"calibrate_plan({type(workload).__name__}): give a Workload or a workload name"
        )
    check_fits_here(built.model, device)
    total = batch or built.batch_size
    one = max(1, total // accumulate)
    cal = calibrate(
        built, micro_batches=micro_sizes(one), steps=steps, device=device, precision=precision
    )
    kind = cal.device.split(":")[0]
    available = hw.cuda_count() if kind == "cuda" else hw.cpu_cores()[1]
    lines = []
    for strategy, n in cases_here(cases, kind=kind, available=available):
        micro = max(1, total // (n * accumulate))
        names = ",".join([kind] * n if kind == "cpu" else [f"cuda:{i}" for i in range(n)])
        lines.append(
            measure_line(
                built, strategy, names, micro_sizes(micro), steps=steps, precision=cal.precision
            )
        )
    return dataclasses.replace(cal, lines=(*cal.lines, *lines))


def measure_line(
    workload: str | Workload,
    strategy: str,
    devices: str,
    micro_batches: tuple[int, int],
    *,
    steps: int = 5,
    precision: str = "auto",
) -> Line:
    """Train ``workload`` with ``strategy`` on ``devices`` (such as ``"cpu,cpu"``) at each of
    ``micro_batches`` per device, ``steps`` timed blocks of steps each after warm-up
    (:func:`~gpukit.planning.calibrate.block_time`); the line through the medians."""
    if strategy not in registered.names():
        raise ConfigError(f"strategy {strategy!r}: use one of {', '.join(registered.names())}")
    rt = Runtime(strategy=strategy, devices=devices, precision=precision)
    n = len(devices.split(","))
    # dp and dp-balanced split one process's batch over the devices; the others take theirs.
    per_process = n if registered.traits(strategy).drives_all_devices else 1
    try:
        with _threads_as_gpukit_train(n if rt.strategy.needs_launch else 1):
            seconds = rt.launch(
                _timed_steps, workload, micro_batches, per_process, steps, hang_timeout=HANG_S
            )
    finally:
        rt.teardown()
    fixed, per_sample = fit_line(list(zip(micro_batches, seconds, strict=True)))
    return Line(strategy, n, micro_batches, (seconds[0], seconds[1]), fixed, per_sample)


def _timed_steps(
    rt: Runtime,
    workload: str | Workload,
    micro_batches: tuple[int, int],
    per_process: int,
    steps: int,
) -> list[float]:
    """On every rank: the median seconds of a step at each micro-batch (rank 0's returned)."""
    built = load_workload(workload, meta=True) if isinstance(workload, str) else workload
    model = copy.deepcopy(built.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=built.lr)
    model, optimizer = rt.setup(model, optimizer)
    criterion = rt.setup_criterion(built.loss)
    device = rt.strategy.device.torch
    sync = synchronizer(device)

    def loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    medians = []
    for b in micro_batches:
        source = batches(built.dataset, b * per_process)

        def step(source: Iterator[Any] = source) -> None:
            batch = to(next(source), device)
            rt.log(loss=rt.train_step(optimizer, batch, loss))

        for _ in range(WARMUP_STEPS):
            step()
        medians.append(statistics.median(block_time(step, sync) for _ in range(steps)))
    return medians


@contextmanager
def _threads_as_gpukit_train(n: int) -> Iterator[None]:
    """``gpukit train`` starts N > 1 processes with one thread each unless OMP_NUM_THREADS is
    set (as torchrun does); ``rt.launch`` gives each this process's count. Time them as
    trained."""
    if n < 2 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


__all__ = ["WARMUP_STEPS", "calibrate_plan", "cases_here", "measure_line", "micro_sizes"]
