"""Cross entropy on logits split by vocabulary, under torch's ``loss_parallel``.

torch computes the loss of a ``Shard(-1)`` DTensor without gathering it only while its
``loss_parallel`` context is on, and its backward needs the context too. The Runtime's
backward knows nothing of it, so the loss is one autograd node of its own: its forward
computes the loss in the context, its backward re-enters the context for the loss's own
graph, and ``rt.backward(loss)`` works unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class LossParallel:
    """``fn(logits, target, ...)``; on a vocabulary-split DTensor, computed under
    ``loss_parallel`` (see the module doc)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, outputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(outputs, DTensor):
            return self.fn(outputs, *args, **kwargs)
        return _Loss.apply(outputs, self.fn, args, kwargs)


class _Loss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Any, fn: Any, args: Any, kwargs: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        with torch.enable_grad(), loss_parallel():
            leaf = logits.detach().requires_grad_(logits.requires_grad)
            loss = fn(leaf, *args, **kwargs)
        ctx.leaf, ctx.loss = leaf, loss
        local = loss.to_local() if isinstance(loss, DTensor) else loss
        return local.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None, None]:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import loss_parallel

        loss = ctx.loss
        if isinstance(loss, DTensor):  # the same on every rank: a replicated gradient
            placements = [Replicate()] * loss.device_mesh.ndim
            grad = DTensor.from_local(grad, loss.device_mesh, placements, run_check=False)
        with loss_parallel():
            torch.autograd.backward(loss, grad)
        leaf_grad = ctx.leaf.grad
        ctx.leaf = ctx.loss = None
        return leaf_grad, None, None, None
