"""Training one configuration of the ``strategies`` experiment and timing it: rounds of two
``fit`` runs whose difference is the steady state, each with its memory report and GPU
utilisation.

Apart from the table it feeds, since how a run is timed (fresh Runtimes, threads shared by
the processes of one launch, a first untimed run in this process) is its own concern.
"""

from __future__ import annotations

import contextlib
import io
import time
from dataclasses import replace
from typing import Any

import torch

from gpukit.bench.strategy_configs import Planned, StrategySweep, default_batch
from gpukit.devices import hw as _hw
from gpukit.devices.utilization import UtilizationSampler
from gpukit.diagnostics.memory import reset_peaks
from gpukit.runtime.runtime import Runtime
from gpukit.train.loop import RUNTIME_DEFAULTS, TrainConfig, fit


def measure_configuration(
    p: Planned, s: StrategySweep
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rounds of (``warmup`` steps, ``warmup + steps`` steps) runs: their samples/s, and the
    last longer run's memory and utilisation."""
    settings_rt = {**RUNTIME_DEFAULTS, "strategy": p.strategy, "devices": list(p.devices or [])}
    probe = Runtime(**settings_rt)  # a configuration the Runtime refuses fails here, at once
    in_process, world = not probe.strategy.needs_launch, probe.world_size
    probe.teardown()
    batch = (s.batch or default_batch(p.workload)) * p.count  # fit's batch is global
    short = TrainConfig(
        workload=p.workload,
        epochs=s.warmup + s.steps,  # at least one step per epoch: never short of steps
        max_steps=s.warmup,
        batch_size=batch,
        progress=False,
        sample=False,
        validate=False,  # training steps only: the timed difference is theirs
    )
    longer = replace(short, max_steps=s.warmup + s.steps)
    # The processes of one launch share the cores: each gets its share (torchrun gives each
    # one thread), so k processes never run more threads than there are cores.
    threads = None if in_process else max(1, _hw.cpu_cores()[1] // world)
    devices = list(p.devices or [])
    # What a run prints (fsdp's plan of groups) is shown by the configuration's first run
    # alone: the others repeat it.
    if in_process:
        _launch(settings_rt, short, threads, devices)  # untimed: first use in this process
    rounds, last = [], {}
    for i in range(s.rounds):
        first = _launch(settings_rt, short, threads, devices, quiet=in_process or i > 0)
        last = _launch(settings_rt, longer, threads, devices, quiet=True)
        taken = last["seconds"] - first["seconds"]
        rounds.append(
            {
                "warmup_seconds": first["seconds"],
                "total_seconds": last["seconds"],
                # Noise can make a tiny difference negative: then the whole run's rate.
                "samples_per_s": s.steps * batch / taken if taken > 0 else last["fit_rate"],
                "method": "difference" if taken > 0 else "whole run",
                "fit_samples_per_s": last["fit_rate"],
            }
        )
    last.update(in_process=in_process, threads_per_process=threads)
    return rounds, last


def _launch(
    settings_rt: dict[str, Any],
    config: TrainConfig,
    threads: int | None,
    devices: list[str],
    quiet: bool = False,
) -> dict[str, Any]:
    """One ``fit`` with a fresh Runtime: its loop time, memory rows and GPU utilisation."""
    rt = Runtime(**settings_rt)
    try:
        reset_peaks(devices)  # the report's peaks are this run's, not an earlier one's
        with UtilizationSampler([torch.device(d) for d in devices]) as util:
            metrics = rt.launch(_measured_fit, config, threads, quiet)
    finally:
        rt.teardown()  # drops the run's model and collects it: it lives in this process
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # for the next configuration, or DDP's processes
    end, seconds = metrics["ended_at"], metrics["seconds"]
    return {
        "seconds": seconds,
        "fit_rate": metrics["samples_per_s"],
        # Per device: dp's one process splits its micro-batch over the devices it drives.
        "micro_batch": metrics["micro_batch"] * metrics["world_size"] // len(devices),
        "precision": metrics["precision"],
        "memory": metrics["memory"]["devices"],
        "model_state": metrics.get("model_state"),
        "utilization": {
            k: v.to_dict() if v else None for k, v in util.stats(end - seconds, end).items()
        },
        "utilization_error": util.error,
    }


def _measured_fit(
    rt: Runtime, config: TrainConfig, threads: int | None, quiet: bool = False
) -> dict[str, Any]:
    """``fit`` on every rank (``quiet``: what it prints left unshown), and when it ended by the
    machine's clock (module level, so that spawned processes can import it)."""
    if threads is not None:
        torch.set_num_threads(threads)
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        metrics = fit(rt, config)
    return {**metrics, "ended_at": time.time()} if metrics else metrics
