"""Pipeline parallel: each rank of the ``pp`` dimension runs some stages of the model
(``pipeline_split``), and a schedule of torch's ``torch.distributed.pipelining`` sends
micro-batches through them, forward and backward together.

The training loop stays the plain one. Because the schedule runs the backward with the
forward, ``model(x)`` returns a stand-in (:class:`PipelineOutput`) that only the criterion
from ``rt.setup_criterion`` accepts: it runs the schedule over the batch cut into
micro-batches (the loss of each, weighted as ``rt.backward`` would weigh it, is what the
schedule differentiates) and returns the batch's loss; ``rt.backward`` then knows that its
backward ran (``Strategy.backward_done``). Any other use of the stand-in is an error that
says so.

What each step adds to the schedule's own sends and receives, and why:

- one broadcast of the loss (one number) from the rank holding the last stage to the other
  ranks of its pipeline, so that the loss, ``rt.log(loss=...)`` and the non-finite guard are
  the same on every rank;
- one all-reduce per tied parameter held by two ranks (gpt's head and token embedding), once
  per optimizer step, over those ranks only: each copy's gradient is the sum of both, as
  autograd makes it for the one parameter of the whole model, so the copies stay equal;
- with clipping or the non-finite guard, one all-reduce of the squared norm over the pipeline.

Evaluation (``model.eval()`` or ``torch.no_grad()``) runs the stages one after another on the
whole batch, and hands the last stage's outputs to every rank of the pipeline (objects sent
and broadcast: a forward for metrics, not a training step).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from gpukit._util.text import described
from gpukit.errors import ConfigError

# name: (torch's class, how stages sit on ranks, the first torch that has it)
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "GPipe": ("ScheduleGPipe", "one", "2.4"),
    "1F1B": ("Schedule1F1B", "one", "2.4"),
    "Interleaved1F1B": ("ScheduleInterleaved1F1B", "looped", "2.4"),
    "LoopedBFS": ("ScheduleLoopedBFS", "looped", "2.4"),
    "InterleavedZeroBubble": ("ScheduleInterleavedZeroBubble", "looped", "2.5"),
    "ZBVZeroBubble": ("ScheduleZBVZeroBubble", "v", "2.6"),
}


@dataclass(frozen=True)
class PipelineOptions:
    """``schedule``: a name of :data:`SCHEDULES`; ``microbatches``: per batch (None: one per
    stage, as torchtitan's default); ``stages_per_rank``: None for the schedule's own (1, or
    2 for the interleaved and V schedules); ``split``: where stages start (None: between the
    model's repeated blocks)."""

    schedule: str = "1F1B"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    split: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"pp_schedule={described(self.schedule)}: give one of {', '.join(SCHEDULES)}"
            )
        for name in ("microbatches", "stages_per_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"pp_{name}={described(value)}: give a whole number, 1 or more (or None "
                    "for the default)"
                )
        cls, style, since = SCHEDULES[self.schedule]
        from torch.distributed import pipelining

        if not hasattr(pipelining, cls):
            raise ConfigError(
                f"pp_schedule={self.schedule!r} needs torch {since} or later (its {cls}); "
                f"this torch is {torch.__version__}: upgrade torch or use '1F1B'"
            )
        spr = self.stages_per_rank
        if style == "one" and spr not in (None, 1):
            raise ConfigError(
                f"pp_schedule={self.schedule!r} runs one stage per rank, not "
                f"pp_stages_per_rank={spr}: use 'Interleaved1F1B' or another looped schedule"
            )
        if style == "v" and spr not in (None, 2):
            raise ConfigError(
                f"pp_schedule={self.schedule!r} runs two stages per rank (a V: the first and "
                f"the last on rank 0), not pp_stages_per_rank={spr}: leave it out"
            )

    @property
    def per_rank(self) -> int:
        style = SCHEDULES[self.schedule][1]
        return self.stages_per_rank or (1 if style == "one" else 2)

    def stage_ids(self, pp: int, pp_rank: int) -> list[int]:
        """The stages rank ``pp_rank`` of the pipeline runs, in order."""
        if SCHEDULES[self.schedule][1] == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(self.per_rank)]

    def holder(self, stage: int, pp: int) -> int:
        """The pipeline rank that runs ``stage``."""
        if SCHEDULES[self.schedule][1] == "v" and stage >= pp:
            return 2 * pp - 1 - stage
        return stage % pp

    def microbatches_for(self, pp: int) -> int:
        return self.microbatches or pp * self.per_rank


class PipelineOutput(torch.Tensor):
    """What ``model(x)`` returns in training under pipeline parallel: the stand-in for the
    last stage's outputs, which the schedule computes together with the loss."""

    run: PipelineRun
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    _READABLE: ClassVar[set[Any]] = set()

    @staticmethod
    def made(run: PipelineRun, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PipelineOutput:
        out = torch.Tensor._make_subclass(PipelineOutput, torch.empty(0))
        out.run, out.args, out.kwargs = run, args, kwargs
        return out

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _metadata():  # its shape and type (a check of the targets reads them)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise ConfigError(
            "under pipeline parallel, model(x) stands for the last stage's outputs, which the "
            "schedule computes together with the loss and its backward: compute the loss "
            "with criterion = rt.setup_criterion(loss_fn), then criterion(model(x), y) (in "
            f"evaluation, under model.eval() or torch.no_grad(), model(x) is the outputs); "
            f"got {getattr(func, '__name__', func)} on it"
        )


def _metadata() -> set[Any]:
    if not PipelineOutput._READABLE:
        t: Any = torch.Tensor  # its properties' getters are what torch hands __torch_function__
        PipelineOutput._READABLE.update(
            {t.shape.__get__, t.ndim.__get__, t.dtype.__get__, t.device.__get__}
            | {t.requires_grad.__get__, t.dim, t.size, t.numel, t.is_floating_point}
        )
    return PipelineOutput._READABLE


class PipelineCriterion:
    """``fn`` run by the schedule when given a :class:`PipelineOutput`; ``fn`` itself on real
    outputs (evaluation)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(outputs, PipelineOutput):
            return self.fn(outputs, targets, *args, **kwargs)
        if args or kwargs:
            raise ConfigError(
                "under pipeline parallel the criterion takes (outputs, targets) only: the "
                "schedule calls it on each micro-batch's outputs; bind other arguments with "
                "functools.partial"
            )
        return outputs.run.train(outputs, targets, self.fn)


class PipelineRun:
    """This rank's stages and the schedule that runs them (see the module docstring)."""

    def __init__(
        self,
        stages: list[nn.Module],
        ids: list[int],
        num_stages: int,
        options: PipelineOptions,
        group: Any,
        ties: list[tuple[list[torch.Tensor], Any]],
        device: torch.device,
        pp: int,
        holders: list[int],
    ) -> None:
        from torch.distributed import pipelining

        self.holders = holders  # the pipeline rank of each stage
        self.stages, self.ids, self.num_stages = stages, ids, num_stages
        self.group, self.ties, self.device = group, ties, device
        self.microbatches = options.microbatches_for(pp)
        self.last_holder = dist.get_global_rank(group, options.holder(num_stages - 1, pp))
        self.holds_last = num_stages - 1 in ids
        self.weight = 1.0
        # The loss's type on every rank (the broadcast's): the weights', as the loss has it.
        floats = (p.dtype for m in stages for p in m.parameters() if p.is_floating_point())
        self.dtype = next(floats, torch.float32)
        self.norm_skip: list[torch.Tensor] = []  # tied copies the gradient norm leaves out
        self.sync_ties = True
        self._fn: Callable[..., torch.Tensor] | None = None
        self._losses: list[torch.Tensor] = []
        # The losses whose backward ran, by id (a weak reference: a loss let go is forgotten).
        self._done: dict[int, weakref.ref[torch.Tensor]] = {}
        pipe_stages = [
            pipelining.PipelineStage(m, i, num_stages, device, group=group)
            for m, i in zip(stages, ids, strict=True)
        ]
        cls = getattr(pipelining, SCHEDULES[options.schedule][0])
        single = SCHEDULES[options.schedule][1] == "one"
        try:
            self.schedule = cls(
                pipe_stages[0] if single else pipe_stages,
                n_microbatches=self.microbatches,
                loss_fn=self._loss,
                # Not the gradients divided at the end of a step: that would divide again
                # those accumulated over earlier steps. Each micro-batch's loss is, in _loss.
                scale_grads=False,
            )
        except (ValueError, AssertionError, RuntimeError) as err:
            raise ConfigError(
                f"pp_schedule={options.schedule!r} with {self.microbatches} micro-batch(es) "
                f"over {pp} pipeline rank(s) and {num_stages} stage(s): {err} (set "
                "pp_microbatches)"
            ) from None

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        assert self._fn is not None  # set by train before the schedule runs
        loss = self._fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ConfigError(
                f"the criterion returned {described(loss)} on a micro-batch: it must reduce "
                "to one number (reduction='mean')"
            )
        self._losses.append(loss.detach())
        # The batch's loss is the mean of the micro-batches': each weighs 1/microbatches.
        return loss * (self.weight / self.microbatches)

    def train(self, out: PipelineOutput, target: Any, fn: Callable[..., torch.Tensor]) -> Any:
        """Forward and backward of the batch through every stage; the batch's loss."""
        first = next((a for a in out.args if isinstance(a, torch.Tensor)), None)
        if first is None or first.dim() == 0 or first.shape[0] % self.microbatches:
            size = "no batch tensor" if first is None else f"a batch of {first.shape[0]}"
            raise ConfigError(
                f"pipeline parallel cuts each batch into {self.microbatches} micro-batches, "
                f"and got {size}: give batches whose size is a multiple of "
                f"{self.microbatches} (drop_last=True in the DataLoader) or set pp_microbatches"
            )
        self._fn, self._losses = fn, []
        try:
            self.schedule.step(*out.args, target=target, return_outputs=False, **out.kwargs)
        finally:
            self._fn = None
        if self.holds_last:
            # The last ones: the schedule's first step also runs a forward of its own, to
            # learn the shapes sent between stages.
            loss = torch.stack(self._losses[-self.microbatches :]).mean().to(self.dtype)
        else:
            loss = torch.zeros((), device=self.device, dtype=self.dtype)
        dist.broadcast(loss, src=self.last_holder, group=self.group)
        if self.sync_ties:
            self.sum_tied_gradients()
        self._done = {k: r for k, r in self._done.items() if r() is not None}
        self._done[id(loss)] = weakref.ref(loss)
        return loss

    def backward_done(self, loss: torch.Tensor) -> bool:
        ref = self._done.get(id(loss))
        return ref is not None and ref() is loss

    def sum_tied_gradients(self) -> None:
        """Each tied parameter's copies get the sum of their gradients (see the module doc)."""
        for copies, group in self.ties:
            grads = [_local(p.grad) for p in copies if p.grad is not None]
            if not grads:  # still in the group's all-reduce: the other ranks wait for it
                if group is None or not copies:
                    continue
                grads = [torch.zeros_like(_local(copies[0]))]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if group is not None:
                total = total.clone() if len(grads) == 1 else total
                dist.all_reduce(total, group=group)
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(total)

    def forward_only(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The stages one after another on the whole batch: the outputs, on every rank."""
        out: Any = None
        for i, (stage, index) in enumerate(zip(self.stages, self.ids, strict=True)):
            if index == 0:
                out = stage(*args, **kwargs)
            else:
                if i == 0 or self.ids[i - 1] != index - 1:
                    out = self._receive(index - 1)
                out = stage(out)
            if index + 1 < self.num_stages and (index + 1 not in self.ids):
                self._send(out, index + 1)
        box = [out if self.holds_last else None]
        dist.broadcast_object_list(box, src=self.last_holder, group=self.group, device=self._on())
        return _to(box[0], self.device)

    def _on(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.holders[stage])

    def _send(self, out: Any, stage: int) -> None:
        dist.send_object_list([out], dst=self._peer(stage), group=self.group, device=self._on())

    def _receive(self, stage: int) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=self._peer(stage), group=self.group, device=self._on())
        return _to(box[0], self.device)


class Pipeline(nn.Module):
    """What ``rt.setup`` returns under pipeline parallel: called as the model (see the module
    docstring). ``stages`` are this rank's; ``view`` their parameters under the whole model's
    names (what checkpoints and ``rt.unwrap`` see)."""

    view: nn.Module
    run: PipelineRun

    def __init__(self, stages: list[nn.Module], view: nn.Module, run: PipelineRun) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.__dict__["view"] = view  # not a child: its parameters are the stages'
        self.__dict__["run"] = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            return PipelineOutput.made(self.run, args, kwargs)
        return self.run.forward_only(args, kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _to(value: Any, device: torch.device) -> Any:
    from gpukit._util.tree import map_tensors

    return map_tensors(value, lambda t: t.to(device))


def combined_norm(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The norm of every stage's gradients from this rank's ``local`` norm (one small
    all-reduce over the pipeline, no read)."""
    squared = local**2
    dist.all_reduce(squared, group=group)
    return squared.sqrt()


__all__ = ["SCHEDULES", "Pipeline", "PipelineCriterion", "PipelineOptions"]
