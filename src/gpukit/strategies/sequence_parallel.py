"""Attention over sequences split across context-parallel ranks.

Each rank of a context-parallel (cp) group holds two chunks of every sequence
(:mod:`~gpukit.strategies.sequence_batches`). Everything in a transformer but attention works
token by token; attention needs the whole sequence. Two ways to give it:

- ``"ulysses"`` (default; DeepSpeed-Ulysses's scheme): one all-to-all trades the split along
  the sequence for a split along the heads (each rank then holds the whole sequence of
  ``heads / cp`` heads), the tokens are put back in their true order for the causal mask, the
  model's own attention kernel runs (any kernel, the CPU's included), and a second all-to-all
  trades back. The all-to-all is autograd-aware: its backward is the same exchange of the
  gradients. Query heads and key/value heads must both divide by cp.
- ``"ring"``: torch's ring attention (``torch.distributed.tensor.experimental``), which passes
  the keys and values around the ranks and never holds the whole sequence; it runs only on
  CUDA's flash, memory-efficient and cuDNN attention kernels.

The model's calls of ``F.scaled_dot_product_attention`` are what is made sequence-parallel:
a ``TorchFunctionMode`` is active during the model's forward (entered and left by forward
hooks on the model), and nothing is patched. A forward that calls no
``scaled_dot_product_attention`` is refused after the first forward (its attention would
have seen only the rank's own tokens), as is an attention mask (a whole-sequence mask cannot
be split with the sequence; ``is_causal=True`` is what is supported).

>>> import torch
>>> heads_of(torch.zeros(2, 8, 16, 4), cp=2, what="query")
8
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from gpukit.errors import ConfigError
from gpukit.strategies import sequence_batches
from gpukit.strategies.sequence_batches import SequenceShards

CpAttention = Literal["ulysses", "ring"]
CP_ATTENTION: tuple[str, ...] = ("ulysses", "ring")
SDPA = F.scaled_dot_product_attention


class _AllToAll(torch.autograd.Function):
    """Rank ``r`` sends ``x[j]`` to rank ``j`` and receives rank ``j``'s ``x[r]`` at ``[j]``.
    With equal pieces the exchange is its own inverse: the backward sends the gradients back
    the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x``'s first dimension (one piece per rank) exchanged across ``group``, with autograd."""
    out: torch.Tensor = _AllToAll.apply(x, group)
    return out


def heads_of(t: torch.Tensor, cp: int, what: str) -> int:
    """The heads of an attention input ``(batch, heads, tokens, head_dim)``, refused where
    they do not split across ``cp`` ranks."""
    if t.dim() != 4:
        raise ConfigError(
            f"context parallel: scaled_dot_product_attention got a {what} of shape "
            f"{tuple(t.shape)}; cp splits (batch, heads, tokens, head_dim) inputs: reshape "
            "to four dimensions before the attention"
        )
    heads = t.shape[1]
    if heads % cp:
        raise ConfigError(
            f"context parallel cp={cp}: the attention's {what} has {heads} heads, which do "
            f"not split across {cp} ranks (Ulysses gives each rank heads/cp of them): use a cp "
            f"that divides {heads}"
            + (
                ", or repeat the key/value heads to the query heads' number before the attention"
                if what != "query"
                else ""
            )
        )
    return heads


class Ulysses:
    """Attention of sequence-split inputs through two all-to-alls (see the module doc)."""

    def __init__(self, shards: SequenceShards, group: Any) -> None:
        self.shards = shards
        self.group = group

    def __call__(
        self,
        sdpa: Callable[..., torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **options: Any,
    ) -> torch.Tensor:
        cp = self.shards.size
        heads_of(query, cp, "query")
        if key.shape[1] != query.shape[1] or value.shape[1] != query.shape[1]:
            heads_of(key, cp, "key/value")
        local = query.shape[2]
        gathered = self.shards.gathered_positions(local, query.device)
        order = torch.argsort(gathered)  # the gathered tokens, put in their true order
        if key.shape == query.shape and value.shape == query.shape:
            q, k, v = self._to_heads(torch.stack((query, key, value)), order).unbind(0)
        else:  # grouped-query attention: the keys and values have fewer heads
            q = self._to_heads(query.unsqueeze(0), order)[0]
            k, v = self._to_heads(torch.stack((key, value)), order).unbind(0)
        out = sdpa(q, k, v, **options)
        return self._to_sequence(out.unsqueeze(0), gathered)[0]

    def _to_heads(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """``(n, batch, heads, local, d)`` split on tokens -> ``(n, batch, heads/cp, tokens,
        d)`` split on heads, tokens in their true order."""
        cp = self.shards.size
        n, b, h, t, d = x.shape
        pieces = x.reshape(n, b, cp, h // cp, t, d).permute(2, 0, 1, 3, 4, 5)
        got = all_to_all(pieces, self.group)  # [j]: rank j's tokens of this rank's heads
        whole = got.permute(1, 2, 3, 0, 4, 5).reshape(n, b, h // cp, cp * t, d)
        return whole.index_select(3, order)

    def _to_sequence(self, x: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_to_heads`."""
        cp = self.shards.size
        n, b, h, length, d = x.shape
        t = length // cp
        pieces = x.index_select(3, gathered).reshape(n, b, h, cp, t, d).permute(3, 0, 1, 2, 4, 5)
        got = all_to_all(pieces, self.group)  # [j]: this rank's tokens of rank j's heads
        return got.permute(1, 2, 0, 3, 4, 5).reshape(n, b, cp * h, t, d)


class Ring:
    """torch's ring attention over the cp mesh dimension (CUDA kernels only). Its load
    balancing is the same two chunks per rank as gpukit's split, so the inputs are handed
    over as they are."""

    def __init__(self, mesh: Any) -> None:
        from torch.distributed.tensor.experimental import _attention

        self.mesh = mesh
        _attention._cp_options.enable_load_balance = True
        # Left on: the backward's attention kernels go through the same dispatch, after the
        # forward's hooks have left. It routes only the SDPA kernels of sharded DTensors.
        _attention._enable_context_parallel_dispatcher()

    def __call__(
        self,
        sdpa: Callable[..., torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        **options: Any,
    ) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        q, k, v = (
            DTensor.from_local(t, self.mesh, [Shard(2)], run_check=False)
            for t in (query, key, value)
        )
        out: torch.Tensor = sdpa(q, k, v, **options)
        return out.to_local()  # type: ignore[attr-defined]  # a DTensor, as its inputs


def check_ring(device: torch.device) -> None:
    """Refuse ring attention where it cannot run: torch's runs only CUDA attention kernels."""
    if device.type != "cuda":
        raise ConfigError(
            f"Parallel(cp_attention='ring') trains on {device.type}, but torch's ring "
            "attention runs only CUDA's flash, memory-efficient and cuDNN attention kernels: "
            "use cp_attention='ulysses' (any attention kernel, the CPU's included)"
        )
    try:
        from torch.distributed.tensor.experimental import _attention
    except ImportError as err:
        raise ConfigError(
            f"Parallel(cp_attention='ring'): this torch ({torch.__version__}) has no ring "
            "attention: use cp_attention='ulysses', or a newer torch"
        ) from err
    if not hasattr(_attention, "_enable_context_parallel_dispatcher"):
        raise ConfigError(
            f"Parallel(cp_attention='ring'): this torch ({torch.__version__}) lacks the ring "
            "attention dispatcher gpukit uses: use cp_attention='ulysses', or a newer torch"
        )


class _SequenceParallelAttention(TorchFunctionMode):
    """Sends the forward's ``scaled_dot_product_attention`` calls to ``attention``."""

    def __init__(self, attention: Callable[..., torch.Tensor], cp: int) -> None:
        super().__init__()
        self.attention = attention
        self.cp = cp
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not SDPA:
            return func(*args, **kwargs)
        self.calls += 1
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, args, strict=False)) | kwargs
        if given.pop("attn_mask", None) is not None:
            raise ConfigError(
                f"context parallel cp={self.cp}: scaled_dot_product_attention was given an "
                "attn_mask, which covers the whole sequence and cannot be split with it: use "
                "is_causal=True (causal attention) or no mask, or train with cp=1"
            )
        query, key, value = (given.pop(n) for n in ("query", "key", "value"))
        return self.attention(func, query, key, value, **given)


# The context-parallel forwards running now (a stack: a forward may call another model).
_forwards: list[SequenceParallel] = []


def recomputation() -> contextlib.AbstractContextManager[None] | None:
    """What a block checkpointed in this forward must be recomputed under in the backward
    (after the forward's hooks have left) to be context-parallel as its forward was; None
    outside a context-parallel forward."""
    return _forwards[-1].active() if _forwards else None


class SequenceParallel:
    """Makes ``module``'s forward context-parallel: its batches' sequences are this rank's
    chunks (``shards``), its ``scaled_dot_product_attention`` calls go through ``attention``,
    and :func:`~gpukit.strategies.sequence_batches.sequence_positions` answers with this
    rank's positions while it runs."""

    def __init__(
        self,
        module: nn.Module,
        shards: SequenceShards,
        attention: Callable[..., torch.Tensor],
        cut: set[int] | None = None,
    ) -> None:
        self.shards = shards
        self.attention = attention
        # The sequence lengths of the batches the strategy has cut (None: not checked).
        self.cut = cut
        self.checked = False
        # One per forward running, None for one on whole sequences (whole_sequences()).
        self._modes: list[_SequenceParallelAttention | None] = []
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave, always_call=True)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run what is inside as this model's forward runs (its attention calls, its
        positions), without the check of the first forward."""
        self._enter(None, ())
        try:
            yield
        finally:
            _forwards.pop()
            sequence_batches.leave()
            mode = self._modes.pop()
            assert mode is not None  # active() always enters one
            mode.__exit__(None, None, None)

    def _enter(self, module: nn.Module | None, args: Any) -> None:
        if module is not None and sequence_batches.taking_whole():
            self._modes.append(None)
            return
        if module is not None and self.cut is not None:
            self._check_cut(module, args)
        mode = _SequenceParallelAttention(self.attention, self.shards.size)
        mode.__enter__()
        self._modes.append(mode)
        sequence_batches.enter(self.shards)
        _forwards.append(self)

    def _check_cut(self, module: nn.Module, args: Any) -> None:
        """Refuse a forward whose input was not cut to this rank's part of its sequences: the
        all-to-alls would take it for a part, and the attention would be wrong."""
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 1), None)
        if first is None or first.shape[1] in (self.cut or ()):
            return
        cp = self.shards.size
        lengths = ", ".join(map(str, sorted(self.cut or ()))) or "none yet"
        raise ConfigError(
            f"context parallel cp={cp}: {type(module).__name__} was called with a sequence of "
            f"{first.shape[1]} tokens, not a length the batches were cut to ({lengths}): "
            "under cp each rank's forward takes its part of every sequence. Feed the model "
            "batches from rt.setup's loader (or cut them with rt.strategy.local_batch), and "
            "make inputs and targets in the dataset, not by shifting a batch after the cut; "
            "call it under gk.whole_sequences() to run it on whole sequences (sampling)"
        )

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._modes:  # the forward was refused before it entered
            return
        mode = self._modes.pop()
        if mode is None:  # on whole sequences: nothing was entered
            return
        _forwards.pop()
        sequence_batches.leave()
        mode.__exit__(None, None, None)
        if not self.checked:
            self.checked = True
            if mode.calls == 0:
                raise ConfigError(
                    f"context parallel cp={self.shards.size}: {type(module).__name__}'s "
                    "forward called no torch.nn.functional.scaled_dot_product_attention, so "
                    "its attention saw only this rank's part of each sequence. gpukit makes "
                    "that function sequence-parallel: compute the model's attention with it "
                    "(is_causal=True), or train with cp=1"
                )


__all__ = [
    "CP_ATTENTION",
    "CpAttention",
    "Ring",
    "SequenceParallel",
    "Ulysses",
    "all_to_all",
    "check_ring",
    "heads_of",
    "recomputation",
]
