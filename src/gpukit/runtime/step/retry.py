"""What retrying a step after running out of memory needs, beside the step itself.

Before each try of a step that may be retried, the buffers a forward changes (BatchNorm's
running statistics) and the random generators are saved (see :mod:`gpukit.runtime.step.snapshot`);
after a try, the ranks agree on whether any of them failed; after a failure, the saved state is
put back, the memory released, and the batch cut into twice as many micro-batches, with a
warning on rank 0. The step itself (:mod:`gpukit.runtime.step.stepper`) decides when each happens.
"""

from __future__ import annotations

import gc
import itertools
import logging
from dataclasses import dataclass

import torch

from gpukit._util.batch import chunk_sizes
from gpukit.checkpoint.live import user_model
from gpukit.diagnostics.trace import untraced
from gpukit.errors import ConfigError
from gpukit.runtime.step.live import StepSettings, StepState
from gpukit.runtime.step.precision import Precision
from gpukit.runtime.step.snapshot import BufferGuard, RngState, SavedBuffers
from gpukit.strategies import Strategy

log = logging.getLogger("gpukit")

Saved = tuple[SavedBuffers, RngState]


@dataclass
class Attempt:
    """How one pass over the micro-batches ended."""

    loss: torch.Tensor | None = None  # the batch's mean loss when every micro-batch fitted
    failed_size: int = 0  # samples in the micro-batch that ran out of memory
    message: str = ""  # its error message (the exception itself is gone, with its memory)


class Retry:
    """Saving, agreeing, restoring and cutting smaller, for ``state``'s models."""

    def __init__(
        self,
        config: StepSettings,
        state: StepState,
        strategy: Strategy,
        precision: Precision,
        hold_back: bool,
    ) -> None:
        self.config, self.state = config, state
        self.strategy, self.precision = strategy, precision
        self.recovery = strategy.recovery
        self.hold_back = hold_back  # gradients held until every rank is known to have fitted
        self._guard: BufferGuard | None = None
        self._guarded = 0  # how many models the guard watches
        self._gpus: list[int] = []  # whose random generators the snapshot saves
        self._collectives_checked = False

    def refuse_collective_forward(self) -> None:
        """SyncBatchNorm gathers statistics over the ranks inside the forward: a rank that
        failed earlier would never join, and the others would wait until the timeout."""
        if self._collectives_checked:
            return
        self._collectives_checked = True
        for module in self.state.modules:
            synced = [
                n
                for n, m in user_model(module, self.strategy, self.precision).named_modules()
                if isinstance(m, torch.nn.SyncBatchNorm)
            ]
            if synced:
                raise ConfigError(
                    f"oom='recover' cannot protect a model whose forward talks to the other "
                    f"ranks (SyncBatchNorm at {', '.join(synced[:3])}): a rank that ran out of "
                    "memory would leave the others waiting. Use oom='raise' or 'auto' (gpukit "
                    "train --oom raise), or plain BatchNorm"
                )

    def agree(self, attempt: Attempt) -> tuple[bool, bool, list[list[bool]]]:
        """(some rank failed, some rank failed with a micro-batch of one sample, the held
        modules' flags agreed over the ranks): one ``any_rank``, so at most one read."""
        failed = attempt.loss is None
        exhausted = failed and attempt.failed_size <= 1
        if not self.hold_back:  # this process alone decides: nothing to agree on, no read
            return failed, exhausted, []
        held = [self.recovery.held_flags(m) for m in self.state.modules]
        agreed = self.strategy.any_rank([failed, exhausted, *itertools.chain(*held)])
        anywhere, at = [], 2
        for flags in held:
            anywhere.append(agreed[at : at + len(flags)])
            at += len(flags)
        return agreed[0], agreed[1], anywhere

    def save(self) -> tuple[SavedBuffers, RngState]:
        if self._guard is None or self._guarded != len(self.state.modules):
            self._guarded = len(self.state.modules)  # setup only ever adds models
            users = [user_model(m, self.strategy, self.precision) for m in self.state.modules]
            self._guard = BufferGuard(users)
            self._gpus = RngState.gpus_of(self.strategy.driven_devices)
        return self._guard.save(), RngState(self._gpus)

    def restore(self, saved: Saved) -> None:
        """Put back what the failed try changed, and hand its memory back."""
        buffers, rng = saved
        assert self._guard is not None  # made by save
        self._guard.restore(buffers)
        rng.restore()
        _release()

    def cut_smaller(self, n: int, sizes: list[int], attempt: Attempt) -> None:
        """Twice as many micro-batches from now on, said on rank 0."""
        state = self.state
        state.oom_split *= 2
        after = chunk_sizes(n, self.config.accumulate * state.oom_split)
        event = {
            "step": state.global_step,
            "micro_batch_before": max(sizes),
            "micro_batch_after": max(after),
            "micro_batches": len(after),
            "error": attempt.message.splitlines()[0] if attempt.message else "on another rank",
        }
        state.oom_events.append(event)
        if self.strategy.rank == 0:
            where = " on at least one rank" if self.strategy.distributed else ""
            log.warning(
                "out of memory at step %d with micro-batches of %d samples%s: retrying the "
                "step as %d micro-batches of at most %d (the batch of %d is unchanged)",
                state.global_step,
                max(sizes),
                where,
                len(after),
                max(after),
                n * self.strategy.world_size,
            )

    def succeeded(self, saved: Saved) -> None:
        """A try fitted: the first time, the guard learns which buffers the steps change."""
        if self._guard is not None and self._guard.changing is None:
            with untraced():
                self._guard.succeeded(saved[0])

    def close(self) -> None:
        self._guard = None
        self._guarded = 0


def _release() -> None:
    """Hand the failed step's memory back before trying again."""
    gc.collect()
    # One call empties the cache of every device; entering another device's scope first would
    # create a CUDA context there (hundreds of MiB), on a GPU that is short of memory.
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
