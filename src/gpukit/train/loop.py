"""The ready-made training loop behind ``gpukit train``.

``fit(rt, config)`` trains a workload with a Runtime on every rank: progress on rank 0 (a bar
on a terminal; elsewhere, in CI logs, pipes and files, a plain line every ``progress_every``
seconds and at the start and end of each epoch), logging that reads the loss back only every
``log_every`` steps, a checkpoint at the end of each epoch (and when ``max_steps`` stops the
run), and at the end a summary with throughput, MFU on GPUs and peak memory per device, written
under ``out`` as ``metrics.json``, ``metrics.csv`` and ``loss.png`` (see
:mod:`gpukit.train.report`), with ``config.toml`` (the flags that make the run again, see
:mod:`gpukit.train.rerun`). A resumed run appends to ``metrics.csv`` and draws ``loss.png``
from the whole run.

A workload's validation set is evaluated at the end of every epoch and where ``max_steps``
stops the run (:mod:`gpukit.train.validation`), into ``rt.log_metrics``; ``seconds`` and
``samples_per_s`` leave that time out (``validation_seconds`` holds it). ``data_wait`` is how
long the steps waited for their batches (see :func:`gpukit.train.report.data_wait`).

>>> import gpukit as gk
>>> config = TrainConfig(workload="mlp", max_steps=3, progress=False)
>>> metrics = gk.Runtime(devices="cpu").launch(fit, config)
>>> metrics["steps"], metrics["strategy"], metrics["micro_batch"]
(3, 'single', 64)
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from gpukit import _env
from gpukit._util.files import write_atomic
from gpukit.diagnostics.memory_breakdown import breakdown
from gpukit.diagnostics.peak_tensors import PeakTensors
from gpukit.diagnostics.trace import untraced
from gpukit.errors import ConfigError, RunComplete
from gpukit.runtime.outputs.progress_displays import Bar, ProgressLines, Quiet
from gpukit.runtime.runtime import Runtime
from gpukit.runtime.settings import record, train_defaults
from gpukit.strategies.sequence_batches import whole_sequences
from gpukit.train import fast, options
from gpukit.train.options import TrainConfig
from gpukit.train.outdir import complete_message
from gpukit.train.report import (
    MetricsCsv,
    data_wait,
    learning_rate,
    metrics,
    read_history,
    run_memory,
    with_peak_tensors,
    write_outputs,
)
from gpukit.train.rerun import rerun_flags, to_toml
from gpukit.train.validation import evaluate
from gpukit.workloads.base import load_workload

# The Runtime settings `gpukit train` uses when given no option (its flags' defaults, and what
# the benchmarks time as "gpukit train's default settings"): declared, with why they differ
# from gk.Runtime's, in gpukit.runtime.settings.
RUNTIME_DEFAULTS: dict[str, Any] = train_defaults()
DEFAULT_OOM: str = RUNTIME_DEFAULTS["oom"]


def fit(rt: Runtime, config: TrainConfig) -> dict[str, Any]:
    """Train ``config.workload`` with ``rt``; rank 0 returns the metrics (others an empty dict)."""
    # Each device's peak of tensor memory over the first steps (gpukit.diagnostics.peak_tensors);
    # a run that fails inside that window takes the counter off too.
    peaks = PeakTensors([d.torch for d in rt.strategy.driven_devices])
    try:
        with fast.tf32(rt.device) as tf32:  # on CUDA (gpukit.train.fast)
            return _fit(rt, config, peaks, tf32)
    finally:
        peaks.stop()


def _fit(rt: Runtime, config: TrainConfig, peaks: PeakTensors, tf32: bool) -> dict[str, Any]:
    started = time.perf_counter()
    workload = load_workload(config.workload, seed=config.seed, meta=True)
    epochs = config.epochs or workload.epochs
    # Split over the ranks that read different samples: tensor and context ranks share theirs.
    shards = rt.strategy.sampler_placement()[0]
    per_rank = micro_batch(config.batch_size or workload.batch_size, shards, rt.accumulate)
    model = workload.model
    lr = config.lr if config.lr is not None else workload.lr
    # fused: one kernel per update on CUDA (gpukit.train.fast), and the only AdamW that can
    # skip a step on the device (nonfinite="skip"); otherwise torch's default, as a plain
    # program gets it.
    fused = fast.fused_adamw(rt.device, model.parameters()) or rt.nonfinite == "skip"
    chosen: dict[str, Any] = {"fused": True} if fused else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **chosen)
    # One loader batch is one optimizer step of this rank; rt.train_step cuts it into the
    # accumulation micro-batches (and into more if memory runs out).
    loader = torch.utils.data.DataLoader(
        workload.dataset, batch_size=per_rank * rt.accumulate, shuffle=True, drop_last=True
    )
    peaks.start(model, optimizer)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    peaks.after_setup(rt.unwrap(model), optimizer)
    criterion = rt.setup_criterion(workload.loss)

    def compute_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    checkpoints = Path(config.out) / "checkpoints" if config.out else None
    resumed = None
    if config.resume or (checkpoints is not None and _env.attempt() > 0):
        # A restarted attempt goes on from the newest good checkpoint, if the run made one.
        # Inside the measuring window: its peak also holds what loading makes on the way
        # (the checkpoint's tensors read before they are copied into the model and optimizer).
        progress = rt.load(_resume_folder(config)) if config.resume else rt.resume()
        resumed = progress["step"] if progress else None
    steps_per_epoch = len(loader)  # at least 1: rt.setup refuses a loader without batches
    total = epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    if resumed is not None and rt.global_step >= total:  # before anything in out is touched
        raise RunComplete(
            complete_message(config.out, rt.global_step, total, epochs, config.max_steps)
        )
    global_batch = per_rank * shards * rt.accumulate
    recorded = _recorded(
        rt, config, epochs=epochs, batch_size=global_batch, lr=lr, compile=config.compile
    )
    # The loggers get the run's own values as hyper-parameters (the Runtime sends its settings
    # by itself): the workload, epochs, global batch size and learning rate it used.
    rt.log_hyperparams(
        {k: v for k, v in recorded.items() if isinstance(v, (bool, int, float, str))}
    )
    csv_log = None
    if config.out and rt.is_global_zero:
        csv_log = MetricsCsv(Path(config.out) / "metrics.csv", resumed)
        flags = rerun_flags(recorded, rt.precision.name, getattr(rt.strategy, "options", None))
        write_atomic(Path(config.out) / "config.toml", to_toml(flags))
    # metrics.csv's columns besides the metrics: all read on the host, nothing from a device.
    before = csv_log.elapsed if csv_log is not None else 0.0  # a resumed run's time so far

    def stamp(record: dict[str, float]) -> dict[str, float]:
        return {
            "epoch": max(1, -(-int(record["step"]) // steps_per_epoch)),
            "elapsed": round(before + time.perf_counter() - started, 3),
            **learning_rate(optimizer),
        }

    validation = workload.validation if config.validate else None
    checked_at, validation_seconds = None, 0.0
    first_step, start = rt.global_step, time.perf_counter()
    if rt.device.type == "cuda" and config.progress:  # where the choice is made
        rt.print(f"gpukit: torch.compile {_compiled(rt, config)['why']}")
    bar = _progress(rt, config, total, steps_per_epoch, global_batch)
    with bar:
        while rt.global_step < total:
            bar.epoch_start(rt.global_step // steps_per_epoch + 1, rt.global_step, rt.history)
            for batch in loader:
                loss = rt.train_step(optimizer, batch, compute_loss)
                rt.log(loss=loss)
                peaks.after_step()
                bar.advance(rt.global_step, rt.history)
                if csv_log is not None:
                    csv_log.update(rt.history, stamp)
                if rt.global_step >= total:
                    break
            if rt.global_step < total:  # the last epoch's end is the line after the last flush
                bar.epoch_end(rt.global_step, rt.history)
            if validation is not None and checked_at != rt.global_step:
                # Before the checkpoint: a run resumed from it keeps this record.
                checking = time.perf_counter()
                accuracy = workload.accuracy
                values = evaluate(rt, model, criterion, validation, per_rank, accuracy=accuracy)
                rt.log_metrics(step=None, **values)  # at the run's step
                checked_at = rt.global_step
                validation_seconds += time.perf_counter() - checking
                if csv_log is not None:
                    csv_log.update(rt.history, stamp)
            if checkpoints is not None and not rt.lifecycle.made(rt.global_step):
                rt.save(checkpoints)
        rt.flush_logs()
        bar.finish(rt.global_step, rt.history)  # the last line shows the last loss
    seconds = time.perf_counter() - start - validation_seconds
    samples_per_s = (rt.global_step - first_step) * global_batch / seconds if seconds else 0.0
    peaks.stop()  # a run shorter than the window
    memory = run_memory(rt)  # every rank takes part: it gathers under DDP
    # Weights, gradients and optimizer state each rank holds (its shards under fsdp): a
    # collective too. float64: exact for any size a device holds.
    with untraced():  # gpukit's own reads, once per run: not the user's to see in a trace
        held = breakdown(rt.unwrap(model), optimizer).total
        model_state = [int(b) for b in rt.all_gather(torch.tensor(held, dtype=torch.float64))]
        memory = with_peak_tensors(rt, memory, peaks.result())
    # Every rank writes the sample: under fsdp each forward gathers the weights from all of
    # them, so rank 0 alone would wait forever. Same weights, same generator: the same text.
    # Its windows are whole sequences, also where ranks split each sequence (context parallel).
    # Pipeline stages: no rank holds the whole model; the set-up one runs every stage.
    sampled = model if rt.strategy.splits_model else rt.unwrap(model)
    with whole_sequences():
        sample = (
            workload.sample(sampled, rt.device)
            if workload.sample is not None and config.sample
            else None
        )
    if not rt.is_global_zero:
        return {}
    history = rt.history
    waited = data_wait(history, seconds)  # this session's records, as seconds is this session's
    if csv_log is not None:
        csv_log.update(history, stamp)
        history = csv_log.whole(history)
    summary = metrics(
        rt,
        workload,
        samples_per_s=samples_per_s,
        seconds=seconds,
        global_batch=global_batch,
        memory=memory,
        config=recorded,
        history=history,
        resumed_from_step=resumed,
    )
    summary["validation_seconds"] = validation_seconds
    summary.update(waited)
    summary["model_state"] = model_state
    # What gpukit train chose for speed on a GPU (gpukit.train.fast), and why.
    summary["fast"] = {"tf32": tf32, "fused_adamw": fused, "compile": _compiled(rt, config)}
    if rt.nonfinite is not None:
        summary["skipped_steps"] = rt.skipped_steps()
    if sample is not None:
        summary["sample"] = sample
    if config.out:
        write_outputs(Path(config.out), summary, history, resumed)
    return summary


def _compiled(rt: Runtime, config: TrainConfig) -> dict[str, Any]:
    """``--compile`` as asked, the Runtime's setting it became, and why."""
    used = rt.settings.compile
    why = config.compile_why or f"{used} (the Runtime's compile setting)"
    return {"asked": config.compile, "used": used, "why": why}


def _recorded(rt: Runtime, config: TrainConfig, **used: Any) -> dict[str, Any]:
    """The run as ``metrics.json`` records it: what it was asked, with the values it used
    where the workload chose them (``used``: never None), and under ``runtime`` every setting
    of its Runtime (apart: ``resume`` there is the Runtime's policy, here ``--resume``), with
    the strategy and precision it chose."""
    runtime = record(rt.settings, strategy=rt.strategy.name)
    runtime["precision"] = rt.precision.name
    return {**options.record(config), **used, "runtime": runtime}


def check(config: TrainConfig, world_size: int, accumulate: int) -> None:
    """Refuse a bad request before any process starts: the workload must load, the batch must
    split, and a resumed run needs its checkpoint."""
    workload = load_workload(config.workload, seed=config.seed, meta=True)
    step_batch = config.batch_size or workload.batch_size
    micro_batch(step_batch, world_size, accumulate)
    samples = len(workload.dataset) if hasattr(workload.dataset, "__len__") else step_batch
    if samples < step_batch:  # the loader drops the last, short batch: it would have none
        raise ConfigError(
            f"one optimizer step needs {step_batch} samples but the {workload.name} dataset "
            f"has {samples}: use a smaller --batch-size"
        )
    if config.resume:
        from gpukit.checkpoint import latest

        with warnings.catch_warnings():  # the load itself warns, once, about a fallback
            warnings.simplefilter("ignore")
            latest(_resume_folder(config))
        read_history(Path(str(config.out)) / "metrics.csv")  # one it cannot extend stops here
    if config.lr is not None and not 0 < config.lr < float("inf"):  # also refuses NaN
        raise ConfigError(
            f"lr={config.lr!r}: give a learning rate above 0 (e.g. --lr 1e-3), or leave it "
            f"out for the workload's ({workload.lr:g})"
        )
    if not config.progress_every >= 0:  # also refuses NaN
        raise ConfigError(
            f"progress_every={config.progress_every!r}: give the seconds between progress "
            "lines, 0 or more (0: a line after every step)"
        )


def planned(config: TrainConfig) -> tuple[int, int]:
    """The optimizer steps ``config`` asks for and its model's parameters: what deciding to
    compile weighs (gpukit.train.fast). A step takes one global batch, whatever the split.

    >>> planned(TrainConfig(workload="mlp", max_steps=40))
    (40, 6532)
    """
    workload = load_workload(config.workload, seed=config.seed, meta=True)
    batch = config.batch_size or workload.batch_size
    samples = len(workload.dataset) if hasattr(workload.dataset, "__len__") else batch
    steps = (config.epochs or workload.epochs) * max(1, samples // batch)
    if config.max_steps is not None:
        steps = min(steps, config.max_steps)
    return steps, sum(p.numel() for p in workload.model.parameters())


def _resume_folder(config: TrainConfig) -> Path:
    if not config.out:
        raise ConfigError("--resume needs --out DIR: the checkpoints live in DIR/checkpoints")
    return Path(config.out) / "checkpoints"


def micro_batch(global_batch: int, world_size: int, accumulate: int) -> int:
    """Samples per rank per micro-step for a global batch; ConfigError if it does not divide.

    >>> micro_batch(64, world_size=2, accumulate=4)
    8
    """
    parts = world_size * accumulate
    if global_batch < parts or global_batch % parts:
        lower = max(parts, global_batch // parts * parts)
        raise ConfigError(
            f"batch size {global_batch} cannot be split over {world_size} rank(s) x {accumulate} "
            f"accumulation step(s): use a multiple of {parts}, e.g. {lower} or {lower + parts}"
        )
    return global_batch // parts


def _progress(
    rt: Runtime, config: TrainConfig, total: int, steps_per_epoch: int, global_batch: int
) -> Quiet:
    if not rt.is_global_zero or not config.progress:
        return Quiet()
    console = Console()
    if console.is_terminal or console.is_jupyter:
        return Bar(total, global_batch, rt.global_step)
    epochs = math.ceil(total / steps_per_epoch)  # the epochs this run reaches
    return ProgressLines(total, epochs, global_batch, rt.global_step, config.progress_every)
