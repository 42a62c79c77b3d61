"""One optimizer step over a batch, cut into micro-batches, that survives running out of memory.

``rt.train_step(optimizer, batch, compute_loss)`` cuts the batch into ``accumulate`` micro-
batches, runs forward and backward on each with the loss weighted by its share of the batch (so
the gradient is exactly that of the whole batch), and steps. With ``Runtime(oom="recover")`` an
out-of-memory error inside the forward or backward does not end the run: the step's gradients
and memory are released, its buffers and random generators are restored, the batch is cut into
twice as many micro-batches, and the step starts again. The effective batch stays the same, and
so does the result for models whose samples do not interact (BatchNorm's statistics do depend on
the micro-batch). Under several processes every rank trains its micro-batches without gradient
synchronisation, the ranks agree on whether anyone failed (one small all-reduce), and only then
are the gradients averaged: no rank is ever left waiting in a collective that another rank
abandoned. The split found stays for the following steps. A micro-batch of one sample that still
does not fit ends the run with the explanation of ``gk.explain``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpukit._util.batch import batch_size, chunk_sizes, split
from gpukit.diagnostics.oom import injected_oom, is_oom
from gpukit.diagnostics.readable import reraise_readable
from gpukit.errors import ConfigError

if TYPE_CHECKING:
    from gpukit.runtime.runtime import Runtime

log = logging.getLogger("gpukit")


@dataclass
class _Attempt:
    """How one pass over the micro-batches ended."""

    loss: torch.Tensor | None = None  # the batch's mean loss when every micro-batch fitted
    failed_size: int = 0  # samples in the micro-batch that ran out of memory
    message: str = ""  # its error message (the exception itself is gone, with its memory)


def run_step(
    rt: Runtime,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    compute_loss: Callable[[Any], torch.Tensor],
) -> torch.Tensor:
    """See the module docstring; ``rt.train_step`` is the public entry."""
    n = batch_size(batch)
    if n is None:
        raise ConfigError(
            f"train_step got a batch of {type(batch).__name__} with no tensor in it: give the "
            "batch as the loader yields it (tensors, or tuples/dicts of tensors)"
        )
    recover = rt.oom == "recover"
    # Under several processes, recovery needs gradients held back until every rank is known
    # to have finished its backward.
    hold_back = recover and rt.world_size > 1
    if hold_back and not rt._recovery_checked:
        _refuse_collective_forward(rt)
    while True:
        sizes = chunk_sizes(n, rt.accumulate * rt.oom_split)
        snapshot = _Snapshot(rt) if recover else None
        attempt = _attempt(rt, batch, sizes, compute_loss, hold_back)
        failed, exhausted = _agree(rt, attempt, hold_back)
        if not failed:
            break
        optimizer.zero_grad(set_to_none=True)
        assert snapshot is not None  # failures come back only in recover mode
        snapshot.restore()
        _release(rt)
        if exhausted:
            raise rt.out_of_memory(attempt.message or "out of memory on another rank", 1)
        _log_retry(rt, n, sizes, attempt)
    if hold_back:
        for module in rt._modules:
            rt.strategy.sync_held(module)
    rt._check_gradients_once()  # a collective under DDP: only once every rank is here
    rt.micro_step += rt.accumulate
    rt._stepped_at = rt.micro_step
    rt._optimizer_step(optimizer)
    assert attempt.loss is not None  # the loop leaves only once every micro-batch fitted
    return attempt.loss


def _refuse_collective_forward(rt: Runtime) -> None:
    """SyncBatchNorm gathers statistics over the ranks inside the forward: a rank that failed
    earlier would never join, and the others would wait until the timeout."""
    rt._recovery_checked = True
    for module in rt._modules:
        synced = [
            n for n, m in rt.unwrap(module).named_modules() if isinstance(m, torch.nn.SyncBatchNorm)
        ]
        if synced:
            raise ConfigError(
                f"oom='recover' cannot protect a model whose forward talks to the other ranks "
                f"(SyncBatchNorm at {', '.join(synced[:3])}): a rank that ran out of memory would "
                "leave the others waiting. Use oom='raise' (gpukit train --oom raise), or plain "
                "BatchNorm"
            )


def _attempt(
    rt: Runtime,
    batch: Any,
    sizes: list[int],
    compute_loss: Callable[[Any], torch.Tensor],
    hold_back: bool,
) -> _Attempt:
    total = sum(sizes)
    chunks = split(batch, sizes) if len(sizes) > 1 else [batch]
    loss_sum: torch.Tensor | None = None
    size = sizes[0]
    try:
        for i, (chunk, size) in enumerate(zip(chunks, sizes, strict=True)):
            last = i == len(sizes) - 1
            for module in rt._modules:
                if hold_back:
                    rt.strategy.hold_sync(module)
                else:
                    rt.strategy.set_backward_sync(module, last)
            if rt.fault_oom_above is not None and size > rt.fault_oom_above:
                raise injected_oom(size, rt.fault_oom_above)
            loss = compute_loss(chunk)
            weighted = loss * (size / total) if len(sizes) > 1 else loss
            rt.precision.backward(weighted)
            loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
    except Exception as err:
        if not is_oom(err):
            reraise_readable(err)  # a known CUDA/NCCL error in words, anything else as it was
        if rt.oom != "recover":
            raise rt.out_of_memory(err, size) from err
        # Only the message leaves this block: the exception's traceback holds the frames, and
        # with them every activation of the failed micro-batch.
        return _Attempt(failed_size=size, message=str(err))
    return _Attempt(loss=loss_sum)


def _agree(rt: Runtime, attempt: _Attempt, hold_back: bool) -> tuple[bool, bool]:
    """(some rank failed, some rank failed with a micro-batch of one sample)."""
    failed = attempt.loss is None
    exhausted = failed and attempt.failed_size <= 1
    if not hold_back:
        return failed, exhausted
    flags = torch.tensor([float(failed), float(exhausted)], device=rt.device.torch)
    anywhere = rt.strategy.all_reduce(flags, "max").tolist()
    return anywhere[0] > 0, anywhere[1] > 0


def _release(rt: Runtime) -> None:
    """Hand the failed step's memory back before trying again."""
    gc.collect()
    # One call empties the cache of every device; entering another device's scope first would
    # create a CUDA context there (hundreds of MiB), on a GPU that is short of memory.
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class _Snapshot:
    """What a failed attempt may have changed besides gradients: buffers (BatchNorm's running
    statistics, its batch count) and the random generators (dropout masks), restored so the
    retry starts from exactly where the step began."""

    def __init__(self, rt: Runtime) -> None:
        self.buffers = [
            (b, b.detach().clone()) for m in rt._modules for b in rt.unwrap(m).buffers()
        ]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.buffers:
                live.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)


def _log_retry(rt: Runtime, n: int, sizes: list[int], attempt: _Attempt) -> None:
    rt.oom_split *= 2
    after = chunk_sizes(n, rt.accumulate * rt.oom_split)
    event = {
        "step": rt.global_step,
        "micro_batch_before": max(sizes),
        "micro_batch_after": max(after),
        "micro_batches": len(after),
        "error": attempt.message.splitlines()[0] if attempt.message else "on another rank",
    }
    rt.oom_events.append(event)
    if rt.is_global_zero:
        where = "" if rt.world_size == 1 else " on at least one rank"
        log.warning(
            "out of memory at step %d with micro-batches of %d samples%s: retrying the step "
            "as %d micro-batches of at most %d (the batch of %d is unchanged)",
            rt.global_step,
            max(sizes),
            where,
            len(after),
            max(after),
            n * rt.world_size,
        )
