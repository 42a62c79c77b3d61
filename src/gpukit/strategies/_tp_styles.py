"""Tensor-parallel styles torch does not ship, for the plans of ``tensor_plans``.

- :class:`LocalHeads`: an attention module whose projections are split by heads keeps its own
  head counts (``n_head``, ``kv_heads``...) for the heads this rank holds, as its forward
  reshapes with them; optionally with its input gathered from sequence shards first.
- :class:`FusedQKVColwise`: a fused ``[q|k|v]`` projection split by columns. A plain column
  split hands rank 0 all of q and part of k, which attention would read as heads of its own;
  this style keeps the weight's plain split (the full weight reads back in its own order) and
  regroups the output so each rank holds whole heads of q, of k and of v.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput

from gpukit.errors import ConfigError
from gpukit.strategies._tp_find import HEAD_COUNTS, KV_HEAD_COUNTS


def _to_local_heads(module: nn.Module, tp: int) -> None:
    for name in (*HEAD_COUNTS, *KV_HEAD_COUNTS):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(module, name, value // tp)


class LocalHeads(ParallelStyle):
    """Divide the attention module's head counts by the tensor-parallel size; with
    ``sequence_parallel``, also gather its first input from sequence shards (``Shard(1)``)
    into the whole sequence, as a local tensor, before the projections read it."""

    def __init__(self, *, sequence_parallel: bool = False, args: int = 1) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.args = args  # the forward's positional arguments; only the first is gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _to_local_heads(module, device_mesh.size())
        _explain_first_failure(module, device_mesh.size())
        if not self.sequence_parallel:
            return module
        rest = (None,) * (self.args - 1)
        gather = PrepareModuleInput(
            input_layouts=(Shard(1), *rest),
            desired_input_layouts=(Replicate(), *rest),
            use_local_output=True,
        )
        return gather._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"LocalHeads(sequence_parallel={self.sequence_parallel})"


def _explain_first_failure(module: nn.Module, tp: int) -> None:
    """Turn a failure of the module's first forward into a ConfigError that says why.

    The plan cannot see the forward's code: one that reshapes by its input's width (nanoGPT's
    ``C // n_head``) rather than by ``head_dim`` or its head counts fails on a rank's share of
    the heads, with a shape error that would not say so. Only the first call is watched: a
    forward that ran once has its shapes right, and later errors (out of memory among them)
    pass unchanged."""
    own = module.__dict__.get("forward")  # a forward replaced on the instance already
    original = module.forward

    def first_forward(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except (RuntimeError, ValueError) as err:
            if isinstance(err, torch.OutOfMemoryError):
                raise
            raise ConfigError(
                f"tensor parallel gave {type(module).__name__} 1/{tp} "
                f"of its heads, and its forward failed on them ({str(err).splitlines()[0]}): it "
                "must reshape by head_dim or by its head-count attributes (n_head, num_heads, "
                "...), which hold the heads of this rank, not by its input's width, e.g. "
                "q.view(batch, time, -1, head_dim). Change that, or give FSDP(tp_plan=...)"
            ) from err
        if own is None:
            del module.forward
        else:
            module.forward = own
        return out

    module.forward = first_forward


class _WholeHeads(torch.autograd.Function):
    """From the full ``[q|k|v]`` output (every rank has it), this rank's slice of each part.

    Backward: each rank's gradient lands in its own columns of a zero tensor, and the sum over
    the ranks fills every column once (sums with zeros: exact), the full gradient each rank
    then takes its plain column shard of."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, rank: int, tp: int, group: Any) -> torch.Tensor:
        ctx.rank, ctx.tp, ctx.group, ctx.width = rank, tp, group, full.shape[-1]
        parts = full.chunk(3, dim=-1)
        return torch.cat([p.chunk(tp, dim=-1)[rank] for p in parts], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full = grad.new_zeros(*grad.shape[:-1], ctx.width)
        part, piece = ctx.width // 3, ctx.width // 3 // ctx.tp
        for i, g in enumerate(grad.chunk(3, dim=-1)):
            start = i * part + ctx.rank * piece
            full[..., start : start + piece] = g
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


class FusedQKVColwise(ColwiseParallel):
    """A fused ``[q|k|v]`` Linear split by columns, its output regrouped into whole heads:
    each rank gets ``[q_r|k_r|v_r]`` (the r-th of ``tp`` equal slices of q, of k and of v).

    The weight is split as any column-split Linear's (``Shard(0)``), so a checkpoint or
    ``full_tensor()`` reads it in its own order. The price is one all-gather of the
    projection's output in the forward and one all-reduce of its gradient in the backward,
    where separate q, k and v projections need neither."""

    def __init__(self) -> None:
        super().__init__(output_layouts=Replicate(), use_local_output=True)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        rank, tp, group = device_mesh.get_local_rank(), device_mesh.size(), device_mesh.get_group()

        def regroup(_: nn.Module, __: Any, output: torch.Tensor) -> torch.Tensor:
            return _WholeHeads.apply(output, rank, tp, group)

        module.register_forward_hook(regroup)
        return module

    def __repr__(self) -> str:
        return "FusedQKVColwise()"
