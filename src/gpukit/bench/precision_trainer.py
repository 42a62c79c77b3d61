"""One variant's training for the ``precision`` experiment: a one-device Runtime in the
variant's precision, the workload's seeded model, AdamW, and a pool of batches drawn once with
a fixed seed and placed on the device, so that every variant sees the same numbers.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from gpukit.bench.timing import synchronizer, time_rounds
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import load_workload

SEED = 0
POOL = 16  # distinct batches, cycled: enough to train on, small enough to sit on the device


@dataclass(frozen=True)
class Variant:
    """One way to train: a Runtime precision, channels_last or not, compiled or not."""

    name: str
    precision: str
    channels_last: bool = False
    compile: bool = False


@dataclass(frozen=True)
class PrecisionTiming:
    """Untimed and timed steps, timed blocks, and the batch on a CPU (None: the workload's)."""

    warmup: int
    steps: int
    rounds: int
    cpu_batch: int | None


def train(
    dev: torch.device, workload: str, variant: Variant, batch: int, s: PrecisionTiming
) -> tuple[list[float], float]:
    """Train ``workload`` in ``variant`` alone on ``dev``: the seconds per step of each timed
    block, and the final loss (the mean over the last block's steps, read once).

    >>> timing = PrecisionTiming(1, 2, 2, None)
    >>> seconds, loss = train(torch.device("cpu"), "mlp", Variant("fp32", "32"), 8, timing)
    >>> len(seconds), loss > 0
    (2, True)
    """
    trainer = Trainer(
        dev, workload, variant, batch_pool(workload, batch, dev, variant.channels_last)
    )
    try:
        trainer.run(s.warmup)
        timings = time_rounds(
            {"one": guarded(trainer, s.steps)},
            s.rounds,
            per=s.steps,
            warmup=0,
            synchronize=synchronizer(dev),
        )
        if trainer.error is not None:
            raise trainer.error
        return list(timings.seconds["one"]), trainer.final_loss()
    finally:
        trainer.close()
        free(variant.compile)


class Trainer:
    """One variant's training: a one-device Runtime, the seeded model, AdamW, and the pool
    of batches it steps through in order."""

    def __init__(self, dev: torch.device, workload: str, variant: Variant, pool: list[Any]) -> None:
        spec = load_workload(workload, seed=SEED)
        self.rt = Runtime("single", precision=variant.precision, devices=[str(dev)], seed=SEED)
        model = spec.model
        if variant.channels_last:
            # Module.to takes memory_format (its 4-D weights turn NHWC); the stubs omit it.
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr)
        model, self.optimizer = self.rt.setup(model, optimizer)
        # Compiled around the Runtime's wrapper, so its autocast is compiled too.
        forward: Any = torch.compile(model) if variant.compile else model
        criterion = self.rt.setup_criterion(spec.loss)
        self.compute_loss = lambda b: criterion(forward(b[0]), b[1])
        self.pool = pool
        self.step = 0
        self.losses: list[torch.Tensor] = []
        self.error: Exception | None = None

    def run(self, steps: int) -> None:
        """``steps`` optimizer steps; their losses stay on the device."""
        self.losses = []
        for _ in range(steps):
            batch = self.pool[self.step % POOL]
            self.losses.append(self.rt.train_step(self.optimizer, batch, self.compute_loss))
            self.step += 1

    def final_loss(self) -> float:
        """The mean loss of the last ``run``'s steps: the one read-back."""
        return float(torch.stack(self.losses).float().mean())

    def close(self) -> None:
        self.rt.teardown()
        self.pool, self.losses = [], []  # the pool is shared: only this reference goes


def guarded(trainer: Trainer, steps: int) -> Callable[[], None]:
    """A timed block of ``trainer``; an error (out of memory, a compile that fails late) is
    kept on the trainer and ends its blocks, not the others'."""

    def block() -> None:
        if trainer.error is None:
            try:
                trainer.run(steps)
            except Exception as err:
                trainer.error = err

    return block


def batch_pool(workload: str, batch: int, dev: torch.device, channels_last: bool) -> list[Any]:
    """``POOL`` batches of ``batch`` samples of ``workload``, the same for every variant,
    on ``dev``."""
    dataset: Any = load_workload(workload, seed=SEED).dataset
    gen = torch.Generator().manual_seed(SEED)
    found = []
    for _ in range(POOL):
        picks = torch.randint(len(dataset), (batch,), generator=gen).tolist()
        x, y = default_collate([dataset[i] for i in picks])
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        found.append((x.to(dev), y.to(dev)))
    return found


def free(compiled: bool) -> None:
    """Let go of what a variant's training left: compiled code (when ``compiled``), garbage,
    the device's cached blocks."""
    if compiled:
        # Compiled code is cached per function: without a reset, later models would pile up
        # recompilations until dynamo gives up and runs them uncompiled.
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
