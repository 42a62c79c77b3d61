"""The training step: backward, optimizer step, clipping, accumulation, and ``train_step``, one
optimizer step over a batch cut into micro-batches that survives running out of memory.

Nothing here reads a value back from the device on the way: the step queues work and returns.
The few reads it does make are named where they happen (16-mixed's inf/NaN check, the ranks'
agreement under ``oom="recover"`` with several processes, one-time checks after the first step).

``train_step(optimizer, batch, compute_loss)`` cuts the batch into ``accumulate`` micro-batches,
runs forward and backward on each with the loss weighted by its share of the batch (so the
gradient is exactly that of the whole batch), and steps. When out-of-memory recovery is on, an
out-of-memory error inside the forward or backward does not end the run: the step's gradients
and memory are released, its buffers and random generators restored, the batch cut into twice as
many micro-batches (all of it :mod:`gpukit.runtime.step.retry`), and the step started again. The
effective batch stays the same, and so does the result for models whose samples do not interact
(BatchNorm's statistics do depend on the micro-batch). Under several processes every rank trains
its micro-batches without gradient synchronisation, the ranks agree on whether anyone failed
(one small all-reduce and one read), and only then are the gradients averaged: no rank is left
waiting in a collective another rank abandoned. That costs DDP its overlap of communication with
the backward, which is why ``oom="auto"`` recovers only in one process. The split found stays
for the following steps. A micro-batch of one sample that still does not fit ends the run with
the explanation of ``gk.explain``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from gpukit._util.batch import batch_size, chunk_sizes, split
from gpukit.checkpoint.live import user_model
from gpukit.diagnostics import profiles
from gpukit.diagnostics.memory import report
from gpukit.diagnostics.memory_breakdown import breakdown
from gpukit.diagnostics.oom import explain
from gpukit.diagnostics.oom_message import is_oom
from gpukit.diagnostics.readable import reraise_readable
from gpukit.diagnostics.trace import untraced
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.launch.faults import OomFault
from gpukit.runtime.step.boundaries import NoBoundaries, StepBoundaries
from gpukit.runtime.step.live import StepSettings, StepState
from gpukit.runtime.step.loss_checks import check_loss, checked_loss_fn
from gpukit.runtime.step.nonfinite import NonFiniteGuard
from gpukit.runtime.step.optimizer_adoption import StaleOptimizers
from gpukit.runtime.step.precision import Precision
from gpukit.runtime.step.retry import Attempt, Retry, Saved
from gpukit.strategies import Strategy

log = logging.getLogger("gpukit")


class Stepper:
    """Backward and step for ``state``'s models, as ``config``, ``strategy`` and
    ``precision`` say; see the module docstring."""

    def __init__(
        self,
        config: StepSettings,
        state: StepState,
        strategy: Strategy,
        precision: Precision,
        fault: OomFault | None = None,
        boundaries: StepBoundaries | None = None,
        guard: NonFiniteGuard | None = None,
    ) -> None:
        self.config = config
        self.boundaries = boundaries or NoBoundaries()
        self.guard = guard
        self.state = state
        self.strategy = strategy
        self.precision = precision
        self.fault, self.recovery = fault or OomFault(), strategy.recovery
        if config.oom == "recover" and not self.recovery.supported:
            raise ConfigError(
                f"oom='recover' cannot be used with strategy {strategy.name!r} over "
                f"{strategy.world_size} ranks: each forward all-gathers the weights from every "
                "rank, so a rank that ran out of memory halfway would leave the others waiting "
                "in a collective. Use oom='raise' (with gpukit train --max-restarts the run "
                "resumes from its last checkpoint), or recover on one rank"
            )
        self.recover = config.recovers(strategy.distributed)
        self.stale = StaleOptimizers()
        # Under several processes, recovery holds gradients back until every rank is known to
        # have finished its backward.
        self.hold_back = self.recover and strategy.distributed
        # Without accumulation or recovery a batch is never cut: train_step's shortest path.
        # (Its backward-sync flag stays on, as sync_next_backward sets it after each step.)
        self.whole_batches = config.accumulate == 1 and not self.recover
        # optimizer -> (its groups' parameter lists and lengths, those parameters in one list)
        self._clip_params: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, tuple[tuple[tuple[int, int], ...], list[torch.Tensor]]
        ] = weakref.WeakKeyDictionary()
        self.retry = Retry(config, state, strategy, precision, self.hold_back)
        self._previous_loss: torch.Tensor | None = None  # see _whole_batch_step
        self._gradients_checked = False

    # -- the manual loop: rt.backward, rt.step -------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward in the run's precision, averaged over accumulated micro-batches."""
        # A pipeline's loss had its backward with its forward (``_backward`` runs none).
        given = loss = loss if self.strategy.backward_done(loss) else check_loss(loss)
        boundaries = self.boundaries
        if self.state.micro_step == self.state.stepped_at:  # the first of a step's windows
            boundaries.step_begins(self.state.global_step, forward=False)  # the forward ran
        boundaries.beat("backward", self.state.global_step)
        if boundaries.poison_loss():
            loss = loss * float("nan")
        if self.guard is not None:
            self.guard.loss(loss)
        if self.config.accumulate > 1:
            loss = loss / self.config.accumulate
        try:
            self._backward(given, loss)
        except Exception as err:
            if is_oom(err):
                raise self.out_of_memory(err) from err
            reraise_readable(err)
        self.state.micro_step += 1
        self.check_gradients_once()
        # The next forward must know whether its backward ends the window: a loop may call
        # rt.backward for every micro-batch and rt.step once (nanoGPT's habit), so the flag
        # follows each backward, not only each step.
        self.sync_next_backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step once every ``accumulate`` calls; True when the optimizer stepped."""
        state = self.state
        if state.micro_step == state.stepped_at:
            raise ConfigError(
                "rt.step(optimizer) was called without rt.backward(loss) since the last step: "
                "call rt.backward(loss) once per micro-batch, then rt.step(optimizer)"
            )
        state.stepped_at = state.micro_step
        if state.micro_step % self.config.accumulate != 0:
            self.sync_next_backward()
            return False
        return self.optimizer_step(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, clip, step and zero the gradients; True unless 16-mixed skipped it."""
        self.boundaries.beat("optimizer", self.state.global_step)
        self.stale.check(optimizer)
        guard, skipping, flag = self.guard, {}, None
        try:
            norm = None
            if self.config.clip is not None:
                self.precision.unscale(optimizer)
                # No read-back: the norm and the scaling stay on the device.
                norm = self.strategy.clip_gradients(self._params(optimizer), self.config.clip)
            if guard is not None:
                guard.check_optimizer(optimizer)
                grads = [p.grad for p in self._params(optimizer) if p.grad is not None]
                norm = self.strategy.gradient_norm(grads) if norm is None else norm
                flag = guard.found(grads, norm)
                skipping = guard.skip_step(optimizer)
            try:
                stepped = self.precision.step(optimizer)
            finally:
                if skipping:
                    guard.restore(optimizer, skipping)  # type: ignore[union-attr]  # set: skipping
        except Exception as err:
            # Not recoverable by smaller micro-batches: the optimizer state is what grew.
            if is_oom(err):
                raise self.out_of_memory(err) from err
            reraise_readable(err)
        optimizer.zero_grad(set_to_none=True)
        for module in self.state.modules:  # on every rank alike, stepped or not: may talk
            self.strategy.after_optimizer_step(module)
        self.state.optimizer_stepped(optimizer, stepped, flag if skipping else None)
        self.state.global_step += 1
        self.sync_next_backward()
        step = self.state.global_step
        if guard is not None:
            guard.update(step)
            if guard.due(step):
                guard.read(self.strategy.rank)  # one small read per logging window
        self.boundaries.step_ended(step)
        profiles.step_ended(self)  # rt.profile / gpukit trace --profile count this step
        return stepped

    def _params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's parameters in the order of the models' ``parameters()`` (those no
        model holds last), listed once (again only if its groups change). The order is the
        plain program's ``clip_grad_norm_(model.parameters())``: the total norm is a float sum,
        and another order (an optimizer with decay and no-decay groups) changes its last bit."""
        groups = optimizer.param_groups
        shape = tuple((id(g["params"]), len(g["params"])) for g in groups)
        cached = self._clip_params.get(optimizer)
        if cached is None or cached[0] != shape:
            position: dict[int, int] = {}
            for model in self.state.modules:
                for p in model.parameters():
                    position.setdefault(id(p), len(position))
            listed = [p for g in groups for p in g["params"]]
            ordered = sorted(listed, key=lambda p: position.get(id(p), len(position)))
            cached = (shape, ordered)
            self._clip_params[optimizer] = cached
        return cached[1]

    def skipped_steps(self) -> int:
        """Steps the non-finite guard skipped so far (one read back; 0 without a guard)."""
        return 0 if self.guard is None else self.guard.read(self.strategy.rank)

    def sync_next_backward(self) -> None:
        """Tell the strategy whether the coming backward ends an accumulation window (only
        then does DDP all-reduce; its forward must already know)."""
        sync = (self.state.micro_step + 1) % self.config.accumulate == 0
        self.strategy.loss_weight(1 / self.config.accumulate)
        for module in self.state.modules:
            self.strategy.set_backward_sync(module, sync)

    def check_gradients_once(self) -> None:
        """After the first backward, let the strategy catch setups that would fail a step
        later. A one-time check (a collective under DDP), so not a per-step cost: it is kept
        out of ``gk.trace()``."""
        if not self._gradients_checked:
            self._gradients_checked = True
            with untraced():
                for module in self.state.modules:
                    self.strategy.check_gradients(module)

    # -- rt.train_step ----------------------------------------------------------------------------
    def train_step(
        self,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        compute_loss: Callable[[Any], torch.Tensor],
    ) -> torch.Tensor:
        """See the module docstring; ``rt.train_step`` is the public entry."""
        compute_loss = checked_loss_fn(compute_loss, self.strategy.backward_done)
        n = batch_size(batch)
        if n is None:
            raise ConfigError(
                f"train_step got a batch of {type(batch).__name__} with no tensor in it: give "
                "the batch as the loader yields it (tensors, or tuples/dicts of tensors)"
            )
        state, config = self.state, self.config
        self.boundaries.step_begins(state.global_step)
        if self.boundaries.poison_loss() or self.guard is not None:
            compute_loss = self._watched(compute_loss)
        retry = self.retry
        if self.whole_batches and state.oom_split == 1:  # a split a checkpoint brought is kept
            taken = self._whole_batch_step(optimizer, batch, n, compute_loss)
            assert not isinstance(taken, str)  # without a save, running out of memory raises
            return taken
        if self.recover and not self.hold_back and config.accumulate * state.oom_split == 1:
            # Recovery in one process, the batch whole: the plain loop's step after saving what
            # a retry needs (the buffers steps change, the random generators). Out of memory,
            # the step is put back and the batch cut, and the loop below goes on from there.
            kept = retry.save()
            loss = self._whole_batch_step(optimizer, batch, n, compute_loss, kept)
            if not isinstance(loss, str):
                return loss
            self._put_back(optimizer, kept)
            if n <= 1:
                raise self.out_of_memory(loss, 1)
            retry.cut_smaller(n, [n], Attempt(failed_size=n, message=loss))
        if self.hold_back:
            retry.refuse_collective_forward()
        while True:
            sizes = chunk_sizes(n, config.accumulate * state.oom_split)
            saved = retry.save() if self.recover else None
            attempt = self._attempt(batch, sizes, compute_loss)
            failed, exhausted, anywhere = retry.agree(attempt)
            if not failed:
                break
            assert saved is not None  # failures come back only when recovering
            self._put_back(optimizer, saved)
            if exhausted:
                raise self.out_of_memory(attempt.message or "out of memory on another rank", 1)
            retry.cut_smaller(n, sizes, attempt)
        if self.hold_back:
            for module, flags in zip(state.modules, anywhere, strict=True):
                self.recovery.sync_held(module, flags)
        if saved is not None:
            retry.succeeded(saved)
        self.check_gradients_once()  # a collective under DDP: only once every rank is here
        state.micro_step += config.accumulate
        state.stepped_at = state.micro_step
        self.optimizer_step(optimizer)
        assert attempt.loss is not None  # the loop leaves only once every micro-batch fitted
        return attempt.loss

    def _put_back(self, optimizer: torch.optim.Optimizer, saved: Saved) -> None:
        """Undo a failed try: its gradients, the modules' state, its buffers and generators."""
        optimizer.zero_grad(set_to_none=True)
        for module in self.state.modules:
            self.recovery.reset_module(module)
        self.retry.restore(saved)

    def _whole_batch_step(
        self,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        n: int,
        compute_loss: Callable[[Any], torch.Tensor],
        saved: Saved | None = None,
    ) -> torch.Tensor | str:
        """The step as a plain loop writes it, for a batch not cut (no accumulation; no
        recovery, or recovery in one process that has not needed to cut): nothing more than
        that loop does (the loop above costs microseconds). With ``saved`` (recovering), out
        of memory returns the error's message instead, the step not taken."""
        message = None
        try:
            self.fault.check(n)
            loss = compute_loss(batch)
            self.boundaries.beat("backward", self.state.global_step)
            self._backward(loss, loss)
            # The last step's loss, and with it its autograd graph, goes now, after this
            # step's forward, where a plain loop's `loss = ...` lets it go. Freed before the
            # optimizer step instead, it measurably slowed small steps on the CPU (allocator
            # reuse). A loss whose backward failed is never kept: its graph holds activations.
            self._previous_loss = loss
        except Exception as err:
            self._previous_loss = None
            if not is_oom(err):
                reraise_readable(err)
            if saved is None:
                raise self.out_of_memory(err, n) from err
            # Only the message leaves this block: the traceback holds every activation.
            message = str(err)
        if message is not None:
            return message
        if saved is not None:
            self.retry.succeeded(saved)
        self.check_gradients_once()
        self.state.micro_step += 1
        self.state.stepped_at = self.state.micro_step
        self.optimizer_step(optimizer)
        return loss.detach()

    def _watched(
        self, compute_loss: Callable[[Any], torch.Tensor]
    ) -> Callable[[Any], torch.Tensor]:
        """``compute_loss`` whose losses the guard notes and an injected fault poisons (only
        when needed: a plain step calls the user's function as is)."""
        poison, guard = self.boundaries.poison_loss(), self.guard

        def watched(batch: Any) -> torch.Tensor:
            loss = compute_loss(batch)
            if poison:
                loss = loss * float("nan")
            if guard is not None:
                guard.loss(loss)
            return loss

        return watched

    def _attempt(
        self, batch: Any, sizes: list[int], compute_loss: Callable[[Any], torch.Tensor]
    ) -> Attempt:
        size = sizes[0]
        try:
            if len(sizes) == 1 and not self.hold_back:
                # The whole batch at once, as a plain loop does it: this runs every step, so
                # it does nothing more than that loop would.
                for module in self.state.modules:
                    self.strategy.set_backward_sync(module, True)
                self.fault.check(size)
                loss = compute_loss(batch)
                self.boundaries.beat("backward", self.state.global_step)
                self._backward(loss, loss)
                self._previous_loss = loss  # freed after the next forward (_whole_batch_step)
                return Attempt(loss=loss.detach())
            return Attempt(loss=self._micro_batches(batch, sizes, compute_loss))
        except Exception as err:
            self._previous_loss = None
            if not is_oom(err):
                reraise_readable(err)  # a known CUDA/NCCL error in words, anything else as is
            size = getattr(err, "gpukit_micro_batch", size)
            if not self.recover:
                raise self.out_of_memory(err, size) from err
            # Only the message leaves this block: the exception's traceback holds the frames,
            # and with them every activation of the failed micro-batch.
            return Attempt(failed_size=size, message=str(err))

    def _micro_batches(
        self, batch: Any, sizes: list[int], compute_loss: Callable[[Any], torch.Tensor]
    ) -> torch.Tensor:
        """Forward and backward over ``batch`` cut to ``sizes``, each loss weighted by its share;
        the batch's mean loss. An error leaves with the size of the micro-batch it came from."""
        self._previous_loss = None
        total = sum(sizes)
        loss_sum: torch.Tensor | None = None
        for i, (chunk, size) in enumerate(zip(split(batch, sizes), sizes, strict=True)):
            last = i == len(sizes) - 1
            for module in self.state.modules:
                if self.hold_back:
                    self.recovery.hold_sync(module, i == 0)
                else:
                    self.strategy.set_backward_sync(module, last)
            try:
                self.fault.check(size)
                self.strategy.loss_weight(size / total)
                weighted = (loss := compute_loss(chunk)) * (size / total)
                self.boundaries.beat("backward", self.state.global_step)
                self._backward(loss, weighted)
            except Exception as err:
                # The ignore: the error carries the micro-batch to the out-of-memory explanation.
                err.gpukit_micro_batch = size  # type: ignore[attr-defined]
                raise
            loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
        assert loss_sum is not None  # sizes is never empty
        return loss_sum

    def _backward(self, loss: torch.Tensor, weighted: torch.Tensor) -> None:
        if not self.strategy.backward_done(loss):  # ``loss``: the criterion's, before weights
            self.precision.backward(weighted)

    def close(self) -> None:
        """Let go of what holds the models: the last loss's graph, the clipping lists, etc."""
        self._previous_loss = None
        self._clip_params.clear()
        self.retry.close()

    # -- explaining ------------------------------------------------------------------------------
    def out_of_memory(
        self, err: BaseException | str, micro_batch: int | None = None
    ) -> OutOfMemory:
        """The error to raise for an out-of-memory ``err``: its numbers, explained with what
        this run knows (weights and optimizer state, the strategy's own advice, imbalance
        between the devices this process drives)."""
        state_bytes = imbalance = None
        # The explanation must never hide the error it explains: what cannot be read is None.
        with contextlib.suppress(Exception):
            total = 0
            for i, module in enumerate(self.state.modules):
                optimizer = self.state.optimizers[i] if i < len(self.state.optimizers) else None
                user = user_model(module, self.strategy, self.precision)
                parts = breakdown(user, optimizer)
                total += parts.parameters + parts.gradients + parts.optimizer_state
            state_bytes = total
        with contextlib.suppress(Exception):
            driven = self.strategy.driven_devices
            if len(driven) > 1:
                imbalance = report([d.torch for d in driven], all_ranks=False).imbalance
        explanation = explain(
            err,
            state_bytes=state_bytes,
            strategy=self.strategy,
            imbalance=imbalance,
            micro_batch=micro_batch,
        )
        return OutOfMemory(str(explanation))
