"""Activation checkpointing of a sharded model's blocks: keep less from the forward, recompute
the rest in the backward.

``"full"`` keeps only each block's input and recomputes the whole block; ``"selective"`` is the
op-level policy large-model trainers use (torchtitan's default): in each block's forward it
keeps the output of every second matrix product (the first, third, ...) and of attention, and
recomputes the rest (the other products, activations, norms, additions): about half of the
memory of keeping every product, for the recomputation of half of them. Both use torch's
non-reentrant checkpoint, the only kind that works with fsdp (the reentrant kind runs the
block's backward outside autograd's view, so fsdp would all-gather its weights twice and miss
its gradients).

The block's ``forward`` is replaced on the instance, not the module wrapped, so the model's
structure, parameter names and state-dict keys stay as the user wrote them. Recomputing
replays the random generators' states, so dropout draws what it drew the first time: the
result is the same, bit for bit, as without checkpointing. Under context parallelism the
recomputation runs under the forward's sequence-parallel attention again
(:func:`~gpukit.strategies.sequence_parallel.recomputation`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_checkpoint

from gpukit.errors import ConfigError
from gpukit.strategies.sequence_parallel import recomputation

MODES = ("off", "full", "selective")

# Matrix products: selective checkpointing keeps every second one's output in a block.
_PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")
# Attention: selective checkpointing keeps its outputs (what this torch has of them).
_ATTENTION = (
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
)


def _ops(names: tuple[str, ...]) -> frozenset[Any]:
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


class Selection:
    """Selective checkpointing's choice for one forward of one block: :meth:`keeps` is asked
    about each operation in the order the forward runs them. Training asks a fresh one per
    block forward (and another for its recomputation); the planner asks one per block too,
    so both keep the same tensors."""

    def __init__(self) -> None:
        self.products = 0
        self._products, self._attention = _ops(_PRODUCTS), _ops(_ATTENTION)

    def keeps(self, op: Any) -> bool:
        """Whether the output of ``op`` (an aten overload) is kept."""
        if op in self._products:
            self.products += 1
            return self.products % 2 == 1
        return op in self._attention


def checkpoint_blocks(blocks: list[nn.Module], mode: str) -> None:
    """Make each of ``blocks`` recompute its activations in the backward (``mode`` "full" or
    "selective"; "off" leaves them alone)."""
    if mode == "off":
        return
    context = _selective_context if mode == "selective" else None
    for block in blocks:
        if getattr(block, "_gpukit_recomputes", None) is not None:
            continue  # set up once: a second setup must not checkpoint a checkpoint
        block.forward = functools.partial(_recomputed, block.forward, context)
        block._gpukit_recomputes = mode  # type: ignore[assignment]


def _recomputed(
    forward: Callable[..., Any], context: Callable[[], Any] | None, *args: Any, **kwargs: Any
) -> Any:
    options: dict[str, Any] = {"use_reentrant": False}
    # A context-parallel forward's attention goes through a mode its hooks leave before the
    # backward: the recomputation enters it again.
    again = recomputation()
    if again is not None:
        options["context_fn"] = functools.partial(_recomputed_in, context, again)
    elif context is not None:
        options["context_fn"] = context
    return torch_checkpoint.checkpoint(forward, *args, **options, **kwargs)


def _recomputed_in(
    context: Callable[[], Any] | None, again: contextlib.AbstractContextManager[None]
) -> tuple[Any, Any]:
    """``context``'s pair of contexts (the forward's, the recomputation's), the second also
    entering ``again``."""
    forward, recompute = (
        context() if context is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    )
    return forward, _both(again, recompute)


@contextlib.contextmanager
def _both(
    outer: contextlib.AbstractContextManager[Any], inner: contextlib.AbstractContextManager[Any]
) -> Iterator[None]:
    with outer, inner:
        yield


def _selective_context() -> Any:
    make = getattr(torch_checkpoint, "create_selective_checkpoint_contexts", None)
    policy = getattr(torch_checkpoint, "CheckpointPolicy", None)
    if make is None or policy is None:  # pragma: no cover - torch < 2.4
        raise ConfigError(
            f"activation_checkpointing='selective' needs torch 2.4 or newer (this is "
            f"{torch.__version__}); use 'full'"
        )
    # The forward and its recomputation each count the products from the first.
    selections = {False: Selection(), True: Selection()}

    def choose(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        keep = selections[bool(ctx.is_recompute)].keeps(op)
        return policy.MUST_SAVE if keep else policy.PREFER_RECOMPUTE

    return make(choose)


def refuse_reentrant(model: nn.Module) -> None:
    """A model whose own layers use reentrant checkpointing cannot be sharded (see above)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            CheckpointWrapper,
        )
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    for name, module in model.named_modules():
        if (
            isinstance(module, CheckpointWrapper)
            and module.checkpoint_impl == CheckpointImpl.REENTRANT
        ):
            raise ConfigError(
                f"fsdp: {name or 'the model'} uses reentrant activation checkpointing "
                "(checkpoint_wrapper with CheckpointImpl.REENTRANT): its backward runs outside "
                "autograd's view, so fsdp would all-gather the weights twice and lose their "
                "gradients. Remove the wrapper and use gk.strategies.FSDP("
                "activation_checkpointing='full' or 'selective'), or "
                "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
            )
