"""The ready-made training loop behind ``gpukit train``.

``fit(rt, config)`` trains a workload with a Runtime on every rank: progress on rank 0 (a bar
on a terminal; elsewhere, in CI logs, pipes and files, a plain line every ``progress_every``
seconds and at the start and end of each epoch), logging that reads the loss back only every
``log_every`` steps, a checkpoint at the end of each epoch (and when ``max_steps`` stops the
run), and at the end a summary with throughput, MFU on GPUs and peak memory per device, written
under ``out`` as ``metrics.json``, ``metrics.csv`` and ``loss.png`` (see
:mod:`gpukit.train.report`). A resumed run appends to ``metrics.csv`` and draws ``loss.png``
from the whole run.

>>> import gpukit as gk
>>> config = TrainConfig(workload="mlp", max_steps=3, progress=False)
>>> metrics = gk.Runtime(devices="cpu").launch(fit, config)
>>> metrics["steps"], metrics["strategy"], metrics["micro_batch"]
(3, 'single', 64)
"""

from __future__ import annotations

import datetime
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from gpukit import _env
from gpukit.diagnostics.memory import breakdown
from gpukit.diagnostics.peak_tensors import PeakTensors
from gpukit.diagnostics.trace import untraced
from gpukit.errors import ConfigError, RunComplete
from gpukit.runtime.runtime import Runtime
from gpukit.runtime.settings import record, train_defaults
from gpukit.train.outdir import complete_message
from gpukit.train.report import (
    MetricsCsv,
    metrics,
    read_history,
    run_memory,
    with_peak_tensors,
    write_outputs,
)
from gpukit.workloads.base import load_workload

# The Runtime settings `gpukit train` uses when given no option (its flags' defaults, and what
# the benchmarks time as "gpukit train's default settings"): declared, with why they differ
# from gk.Runtime's, in gpukit.runtime.settings.
RUNTIME_DEFAULTS: dict[str, Any] = train_defaults()
DEFAULT_OOM: str = RUNTIME_DEFAULTS["oom"]
# Seconds between progress lines when stdout is not a terminal: often enough to see a run is
# alive in a CI log, rarely enough not to flood it.
DEFAULT_PROGRESS_EVERY = 30.0


@dataclass(frozen=True)
class TrainConfig:
    """What ``gpukit train`` was asked to do; None means the workload's default."""

    workload: str = "gpt"
    epochs: int | None = None
    max_steps: int | None = None
    batch_size: int | None = None  # global: samples per optimizer step over all ranks
    lr: float | None = None
    seed: int = 0
    out: str | None = None
    resume: bool = False  # continue from out's newest checkpoint (restarted attempts always do)
    progress: bool = True  # progress on rank 0 (off when stdout carries JSON)
    progress_every: float = DEFAULT_PROGRESS_EVERY  # seconds between lines off a terminal
    sample: bool = True  # generate text at the end, for workloads that can


def fit(rt: Runtime, config: TrainConfig) -> dict[str, Any]:
    """Train ``config.workload`` with ``rt``; rank 0 returns the metrics (others an empty dict)."""
    # Each device's peak of tensor memory over the first steps (gpukit.diagnostics.peak_tensors);
    # a run that fails inside that window takes the counter off too.
    peaks = PeakTensors([d.torch for d in rt.strategy.driven_devices])
    try:
        return _fit(rt, config, peaks)
    finally:
        peaks.stop()


def _fit(rt: Runtime, config: TrainConfig, peaks: PeakTensors) -> dict[str, Any]:
    workload = load_workload(config.workload, seed=config.seed)
    epochs = config.epochs or workload.epochs
    per_rank = micro_batch(config.batch_size or workload.batch_size, rt.world_size, rt.accumulate)
    model = workload.model
    lr = config.lr if config.lr is not None else workload.lr
    # fused: the only AdamW that can skip a step on the device (nonfinite="skip"); otherwise
    # torch's default, as a plain program gets it.
    fused: dict[str, Any] = {"fused": True} if rt.nonfinite == "skip" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, **fused)
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
    global_batch = per_rank * rt.world_size * rt.accumulate
    csv_log = (
        MetricsCsv(Path(config.out) / "metrics.csv", resumed)
        if config.out and rt.is_global_zero
        else None
    )
    first_step, start = rt.global_step, time.perf_counter()
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
                    csv_log.update(rt.history)
                if rt.global_step >= total:
                    break
            if rt.global_step < total:  # the last epoch's end is the line after the last flush
                bar.epoch_end(rt.global_step, rt.history)
            if checkpoints is not None and rt.lifecycle.saved_step != rt.global_step:
                rt.save(checkpoints)
        rt.flush_logs()
        bar.finish(rt.global_step, rt.history)  # the last line shows the last loss
    seconds = time.perf_counter() - start
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
    sample = (
        workload.sample(rt.unwrap(model), rt.device)
        if workload.sample is not None and config.sample
        else None
    )
    if not rt.is_global_zero:
        return {}
    history = rt.history
    if csv_log is not None:
        csv_log.update(history)
        history = csv_log.whole(history)
    summary = metrics(
        rt,
        workload,
        samples_per_s=samples_per_s,
        seconds=seconds,
        global_batch=global_batch,
        memory=memory,
        config=_recorded(rt, config, epochs=epochs, batch_size=global_batch, lr=lr),
        history=history,
        resumed_from_step=resumed,
    )
    summary["model_state"] = model_state
    if rt.nonfinite is not None:
        summary["skipped_steps"] = rt.skipped_steps()
    if sample is not None:
        summary["sample"] = sample
    if config.out:
        write_outputs(Path(config.out), summary, history, resumed)
    return summary


def _recorded(rt: Runtime, config: TrainConfig, **used: Any) -> dict[str, Any]:
    """The run as ``metrics.json`` records it: what it was asked, with the values it used
    where the workload chose them (``used``), and under ``runtime`` every setting of its
    Runtime (apart: ``resume`` there is the Runtime's policy, here ``--resume``)."""
    runtime = record(rt.settings, strategy=rt.strategy.name)
    return {**asdict(config), **used, "runtime": runtime}


def check(config: TrainConfig, world_size: int, accumulate: int) -> None:
    """Refuse a bad request before any process starts: the workload must load, the batch must
    split, and a resumed run needs its checkpoint."""
    workload = load_workload(config.workload, seed=config.seed)
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


class _Quiet:
    """No progress shown: ranks other than 0, or ``progress=False``. The loop tells every
    kind of progress the same things: an epoch starts, a step ends, an epoch ends, the run
    ends; each with the step and what ``rt.log`` has read back so far."""

    def __enter__(self) -> _Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing was opened, so nothing closes."""

    def epoch_start(self, epoch: int, step: int, history: list[dict[str, float]]) -> None:
        """Epoch ``epoch`` starts at ``step``: shown by the displays that show anything."""

    def advance(self, step: int, history: list[dict[str, float]]) -> None:
        """Optimizer step ``step`` ended."""

    def epoch_end(self, step: int, history: list[dict[str, float]]) -> None:
        """An epoch ended at ``step``."""

    def finish(self, step: int, history: list[dict[str, float]]) -> None:
        """The run ended at ``step``; ``history`` holds its last read-back."""


def _last_loss(history: list[dict[str, float]]) -> float | None:
    return next((r["loss"] for r in reversed(history) if "loss" in r), None)


class _Bar(_Quiet):
    """rich's progress bar, redrawn in place: on a terminal, or in a notebook."""

    def __init__(self, total: int, global_batch: int, first_step: int) -> None:
        self.global_batch, self.first_step = global_batch, first_step
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]:.0f} samples/s"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task("train", total=total, loss="-", rate=0.0)
        self.start = time.perf_counter()

    def __enter__(self) -> _Bar:
        self.progress.start()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def epoch_start(self, epoch: int, step: int, history: list[dict[str, float]]) -> None:
        self.advance(step, history)

    def advance(self, step: int, history: list[dict[str, float]]) -> None:
        loss = _last_loss(history)
        elapsed = time.perf_counter() - self.start
        rate = (step - self.first_step) * self.global_batch / elapsed if elapsed else 0.0
        shown = f"{loss:.4f}" if loss is not None else "-"  # "-": nothing read back yet
        self.progress.update(self.task, completed=step, loss=shown, rate=rate)

    def epoch_end(self, step: int, history: list[dict[str, float]]) -> None:
        self.advance(step, history)

    def finish(self, step: int, history: list[dict[str, float]]) -> None:
        self.advance(step, history)


class ProgressLines(_Quiet):
    """Progress as plain lines, for output that is not a terminal (CI logs, pipes, files),
    where a redrawn bar would be lost or come out as control characters: a line at the start
    and end of each epoch, at the end, and after a step when ``every`` seconds have passed
    since the last line (0: after every step). Each line: steps, epoch, the last loss read
    back, samples/s and the time left, from ``clock`` (seconds).

    >>> clock = iter([0.0, 0.0, 10.0, 31.0, 40.0]).__next__
    >>> lines = ProgressLines(total=4, epochs=1, global_batch=8, first_step=0, every=30,
    ...                       clock=clock, out=sys.stdout)
    >>> with lines:
    ...     lines.epoch_start(1, 0, [])
    ...     lines.advance(1, [])                              # 10 s: too soon for a line
    ...     lines.advance(2, [{"step": 2.0, "loss": 0.5}])    # 31 s
    ...     lines.finish(4, [{"step": 4.0, "loss": 0.25}])    # 40 s
    train 0/4 steps (0%), epoch 1/1, loss -, - samples/s, ETA -
    train 2/4 steps (50%), epoch 1/1, loss 0.5000, 1 samples/s, ETA 0:00:31
    train 4/4 steps (100%), epoch 1/1, loss 0.2500, 1 samples/s, ETA 0:00:00
    """

    def __init__(
        self,
        total: int,
        epochs: int,
        global_batch: int,
        first_step: int,
        every: float,
        clock: Callable[[], float] = time.monotonic,
        out: IO[str] | None = None,
    ) -> None:
        self.total, self.epochs, self.every = total, epochs, every
        self.global_batch, self.first_step = global_batch, first_step
        self.clock, self.out = clock, out
        self.epoch = 1
        self.start = self.last_time = 0.0
        self.last_shown: tuple[int, float | None] | None = None  # (step, loss) of the last line

    def __enter__(self) -> ProgressLines:
        self.start = self.last_time = self.clock()
        return self

    def epoch_start(self, epoch: int, step: int, history: list[dict[str, float]]) -> None:
        self.epoch = epoch
        self._line(step, history, self.clock())

    def advance(self, step: int, history: list[dict[str, float]]) -> None:
        now = self.clock()
        if now - self.last_time >= self.every:
            self._line(step, history, now)

    def epoch_end(self, step: int, history: list[dict[str, float]]) -> None:
        if (step, _last_loss(history)) != self.last_shown:  # not the line just printed again
            self._line(step, history, self.clock())

    def finish(self, step: int, history: list[dict[str, float]]) -> None:
        self.epoch_end(step, history)

    def _line(self, step: int, history: list[dict[str, float]], now: float) -> None:
        loss = _last_loss(history)
        done, elapsed = step - self.first_step, now - self.start
        rate = eta = "-"
        if done > 0 and elapsed > 0:
            rate = f"{done * self.global_batch / elapsed:.0f}"
            left = (self.total - step) * elapsed / done
            eta = str(datetime.timedelta(seconds=round(left)))
        print(
            f"train {step}/{self.total} steps ({step / self.total:.0%}), epoch "
            f"{self.epoch}/{self.epochs}, loss {f'{loss:.4f}' if loss is not None else '-'}, "
            f"{rate} samples/s, ETA {eta}",
            file=self.out or sys.stdout,
            flush=True,
        )
        self.last_time, self.last_shown = now, (step, loss)


def _progress(
    rt: Runtime, config: TrainConfig, total: int, steps_per_epoch: int, global_batch: int
) -> _Quiet:
    if not rt.is_global_zero or not config.progress:
        return _Quiet()
    console = Console()
    if console.is_terminal or console.is_jupyter:
        return _Bar(total, global_batch, rt.global_step)
    epochs = math.ceil(total / steps_per_epoch)  # the epochs this run reaches
    return ProgressLines(total, epochs, global_batch, rt.global_step, config.progress_every)
