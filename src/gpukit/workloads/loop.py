"""The ready-made training loop behind ``gpukit train``.

``fit(rt, config)`` trains a workload with a Runtime on every rank: a progress bar on rank 0,
logging that reads the loss back only every ``log_every`` steps, a checkpoint at the end of each
epoch (and when ``max_steps`` stops the run), and at the end a summary with throughput, MFU on
GPUs and peak memory per device, written under ``out`` as ``metrics.json``, ``metrics.csv`` and
``loss.png`` (see :mod:`gpukit.workloads.report`).

>>> import gpukit as gk
>>> config = TrainConfig(workload="mlp", max_steps=3, progress=False)
>>> metrics = gk.Runtime(devices="cpu").launch(fit, config)
>>> metrics["steps"], metrics["strategy"], metrics["micro_batch"]
(3, 'single', 64)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from gpukit.errors import ConfigError
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import load_workload
from gpukit.workloads.report import metrics, run_memory, write_outputs

# The Runtime settings `gpukit train` uses when given no option: its command line's defaults,
# and what the benchmarks time as "gpukit train's default settings". oom "auto": recovery
# where it costs nothing per step (one process; see gpukit.runtime.step).
RUNTIME_DEFAULTS: dict[str, Any] = {
    "strategy": "auto",
    "precision": "auto",
    "devices": "auto",
    "accumulate": 1,
    "seed": 0,
    "log_every": 10,
    "oom": "auto",
}
DEFAULT_OOM: str = RUNTIME_DEFAULTS["oom"]


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
    resume: bool = False
    progress: bool = True  # the progress bar on rank 0 (off when stdout carries JSON)
    sample: bool = True  # generate text at the end, for workloads that can


def fit(rt: Runtime, config: TrainConfig) -> dict[str, Any]:
    """Train ``config.workload`` with ``rt``; rank 0 returns the metrics (others an empty dict)."""
    workload = load_workload(config.workload, seed=config.seed)
    epochs = config.epochs or workload.epochs
    per_rank = micro_batch(config.batch_size or workload.batch_size, rt.world_size, rt.accumulate)
    model = workload.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr or workload.lr)
    # One loader batch is one optimizer step of this rank; rt.train_step cuts it into the
    # accumulation micro-batches (and into more if memory runs out).
    loader = torch.utils.data.DataLoader(
        workload.dataset, batch_size=per_rank * rt.accumulate, shuffle=True, drop_last=True
    )
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    criterion = rt.setup_criterion(workload.loss)

    def compute_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    checkpoints = Path(config.out) / "checkpoints" if config.out else None
    if config.resume:
        rt.load(_resume_folder(config))
    steps_per_epoch = len(loader)
    if steps_per_epoch == 0:
        raise ConfigError(
            f"one optimizer step needs {per_rank * rt.world_size * rt.accumulate} samples but "
            f"the {workload.name} dataset has {len(workload.dataset)}: use a smaller --batch-size"  # type: ignore[arg-type]
        )
    total = epochs * steps_per_epoch
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    global_batch = per_rank * rt.world_size * rt.accumulate
    first_step, start = rt.global_step, time.perf_counter()
    with _progress(rt, total, config.progress) as bar:
        while rt.global_step < total:
            for batch in loader:
                loss = rt.train_step(optimizer, batch, compute_loss)
                bar.advance(rt, global_batch, start, first_step)
                rt.log(loss=loss)
                if rt.global_step >= total:
                    break
            if checkpoints is not None:
                rt.save(checkpoints)
        rt.flush_logs()
        bar.advance(rt, global_batch, start, first_step)  # the final bar shows the last loss
    seconds = time.perf_counter() - start
    samples_per_s = (rt.global_step - first_step) * global_batch / seconds if seconds else 0.0
    memory = run_memory(rt)  # every rank takes part: it gathers under DDP
    if not rt.is_global_zero:
        return {}
    summary = metrics(
        rt,
        workload,
        samples_per_s=samples_per_s,
        seconds=seconds,
        global_batch=global_batch,
        memory=memory,
        config=asdict(config),
    )
    if workload.sample is not None and config.sample:
        summary["sample"] = workload.sample(rt.unwrap(model), rt.device)
    if config.out:
        write_outputs(Path(config.out), summary, rt.history)
    return summary


def check(config: TrainConfig, world_size: int, accumulate: int) -> None:
    """Refuse a bad request before any process starts: the workload must load, the batch must
    split, and a resumed run needs its checkpoint."""
    workload = load_workload(config.workload, seed=config.seed)
    micro_batch(config.batch_size or workload.batch_size, world_size, accumulate)
    if config.resume:
        from gpukit.runtime.checkpoint import latest

        latest(_resume_folder(config))


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


class _Bar:
    """The progress bar on rank 0; a no-op elsewhere."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.task = (
            progress.add_task("train", total=total, loss="-", rate=0.0) if (progress) else None
        )

    def advance(self, rt: Runtime, global_batch: int, start: float, first_step: int) -> None:
        if self.progress is None or self.task is None:
            return
        # The loss shown is the last one read back by rt.log: no per-step synchronisation.
        loss = f"{rt.history[-1]['loss']:.4f}" if rt.history else "-"  # none read back yet
        elapsed = time.perf_counter() - start
        rate = (rt.global_step - first_step) * global_batch / elapsed if elapsed else 0.0
        self.progress.update(self.task, completed=rt.global_step, loss=loss, rate=rate)

    def __enter__(self) -> _Bar:
        if self.progress is not None:
            self.progress.start()
            if self.task is not None:
                self.progress.update(self.task, completed=0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _progress(rt: Runtime, total: int, shown: bool) -> _Bar:
    if not rt.is_global_zero or not shown:
        return _Bar(None, total)
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]:.0f} samples/s"),
        TimeRemainingColumn(),
    )
    return _Bar(progress, total)
