"""A decoder's sizes, as the layout planner reads them: what tensor, pipeline and context
parallelism split, counted from the shapes alone (no forward, no memory).

The layout planner (:mod:`gpukit.planning.layout_search`) plans a Llama-style decoder: blocks of
attention with grouped-query heads and a SwiGLU feed-forward, an embedding and an output head.
:func:`shape_of` reads it from a gpukit Llama (a Workload, its model, or a
:class:`~gpukit.workloads.llama.LlamaShape` with a sequence length), so that the same facts come
out whichever is given.

>>> from gpukit.workloads.llama import llama3_8b
>>> s = shape_of(llama3_8b(seq_len=8192))
>>> s.layers, s.seq_len, round(s.parameters / 1e9, 2)
(32, 8192, 8.03)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpukit.errors import ConfigError
from gpukit.workloads.base import Workload
from gpukit.workloads.llama import Llama, LlamaShape


@dataclass(frozen=True)
class TransformerShape:
    """A Llama-style decoder at ``seq_len`` tokens per sample (see the module doc)."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    vocab: int
    seq_len: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): the key/value heads times a head's width."""
        return self.kv_heads * self.head_dim

    @property
    def block_matrix_params(self) -> int:
        """One block's weights in matrix products: q, k, v, o and the SwiGLU's three."""
        return 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.hidden

    @property
    def block_params(self) -> int:
        """One block's weights: its matrices and its two norms."""
        return self.block_matrix_params + 2 * self.dim

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.dim

    @property
    def head_params(self) -> int:
        """The output head's weights and the final norm's (the head counted once when tied)."""
        return (0 if self.tied else self.vocab * self.dim) + self.dim

    @property
    def parameters(self) -> int:
        return self.layers * self.block_params + self.embedding_params + self.head_params


def shape_of(model: Any, seq_len: int | None = None) -> TransformerShape:
    """The :class:`TransformerShape` of ``model``: a TransformerShape (returned as it is, or at
    ``seq_len``), a gpukit Workload of a Llama or its model (the sequence its data yields, or
    ``seq_len``), or a :class:`~gpukit.workloads.llama.LlamaShape` with ``seq_len``.

    >>> shape_of(LlamaShape(layers=2), seq_len=1024).parameters
    1486901248
    >>> import torch
    >>> shape_of(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: the layout planner plans a Llama-style decoder; got Linear: ...
    """
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise ConfigError(f"seq_len={seq_len!r}: give a whole number of tokens, at least 1")
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len!r}: give a whole number of tokens, at least 1")
    if isinstance(model, TransformerShape):
        return model if seq_len is None else _with_seq(model, seq_len)
    if isinstance(model, LlamaShape):
        if seq_len is None:
            raise ConfigError(
                "a LlamaShape has no sequence length: pass seq_len= (tokens per sample)"
            )
        return _from_llama(model, seq_len)
    if isinstance(model, Workload):
        seen = getattr(model.dataset, "seq_len", None)
        return shape_of(model.model, seq_len or seen)
    if isinstance(model, Llama):
        block: Any = model.layers[0]
        shape = LlamaShape(
            dim=model.tok_embeddings.embedding_dim,
            layers=len(model.layers),
            heads=int(block.attention.heads),
            kv_heads=int(block.attention.kv_heads),
            hidden=int(block.w1.out_features),
            vocab=model.tok_embeddings.num_embeddings,
            tied=model.output.weight is model.tok_embeddings.weight,
        )
        return _from_llama(shape, seq_len or int(model.rope.max_seq_len))
    raise ConfigError(
        f"the layout planner plans a Llama-style decoder; got {type(model).__name__}: give a "
        "gpukit.workloads.llama workload or model (llama3_8b, llama3_70b, llama3_405b, "
        "llama(LlamaShape(...))), or a gpukit.planning.layout_shape.TransformerShape"
    )


def _from_llama(s: LlamaShape, seq_len: int) -> TransformerShape:
    return TransformerShape(
        s.dim, s.layers, s.heads, s.kv_heads, s.hidden, s.vocab, seq_len, tied=s.tied
    )


def _with_seq(s: TransformerShape, seq_len: int) -> TransformerShape:
    return TransformerShape(
        s.dim, s.layers, s.heads, s.kv_heads, s.hidden, s.vocab, seq_len, tied=s.tied
    )


__all__ = ["TransformerShape", "shape_of"]
