"""A Llama-style decoder built on the meta device from plain torch modules: shapes without
memory, for planning models that do not fit this machine (``gpukit plan --workload
gpukit.workloads.llama:llama3_8b``). Nothing is downloaded and nothing is allocated: the
parameters are meta tensors, the dataset yields ``seq_len`` random token ids per sample.

The 8B shape is Llama 3 8B's: 32 blocks of width 4096, 32 query heads and 8 key/value heads
(grouped-query attention), a SwiGLU feed-forward of 14336, RMSNorm, rotary positions, a
128256-token vocabulary with untied input and output embeddings (8.03e9 parameters). The loss
upcasts the logits to float32 before the cross entropy, as large-vocabulary trainers do.

>>> w = llama3_8b()
>>> round(sum(p.numel() for p in w.model.parameters()) / 1e9, 2), w.model.output.weight.is_meta
(8.03, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gpukit.strategies.sequence_batches import sequence_rows
from gpukit.workloads.base import Workload, replaced
from gpukit.workloads.tokens import RandomTokens


@dataclass(frozen=True)
class LlamaShape:
    """A decoder's sizes (Llama 3 8B's by default)."""

    dim: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    hidden: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    tied: bool = False  # the output head shares the input embedding's weight


class _Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * self.head_dim, s.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads counted from the projections' widths: under tensor parallelism a rank holds
        # some of them (the same ratio of query to key/value heads).
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        repeat = self.heads // self.kv_heads
        k, v = (z.repeat_interleave(repeat, dim=2) for z in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos and sin: the angles of x's tokens, (tokens, pairs).
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1).type_as(x)


class _Block(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.attention = _Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.w1 = nn.Linear(s.dim, s.hidden, bias=False)
        self.w2 = nn.Linear(s.hidden, s.dim, bias=False)
        self.w3 = nn.Linear(s.dim, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class _Rotary(nn.Module):
    """Rotary positions' cosines and sines (buffers, not saved), computed by
    ``reset_parameters`` so that a meta-device model gets them once it has memory."""

    def __init__(self, s: LlamaShape, max_seq_len: int) -> None:
        super().__init__()
        self.pairs, self.theta, self.max_seq_len = s.dim // s.heads // 2, s.rope_theta, max_seq_len
        self.register_buffer("cos", torch.empty(max_seq_len, self.pairs), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, self.pairs), persistent=False)
        if not self.cos.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        cos, sin = cast(torch.Tensor, self.cos), cast(torch.Tensor, self.sin)
        steps = torch.arange(self.pairs, dtype=torch.float32, device=cos.device)
        freqs = 1.0 / (self.theta ** (steps / self.pairs))
        positions = torch.arange(self.max_seq_len, dtype=torch.float32, device=cos.device)
        angles = torch.outer(positions, freqs)
        with torch.no_grad():
            cos.copy_(angles.cos())
            sin.copy_(angles.sin())


class Llama(nn.Module):
    """The decoder: token ids ``(batch, seq)`` in, logits ``(batch, seq, vocab)`` out."""

    def __init__(self, s: LlamaShape, max_seq_len: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.output = nn.Linear(s.dim, s.vocab, bias=False)
        if s.tied:
            self.output.weight = self.tok_embeddings.weight
        self.rope = _Rotary(s, max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds only some of these (the others None): see gpt's GPT.
        x = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        # The tokens' places in the whole sequence: under context parallelism this rank holds
        # only some of them (arange otherwise).
        length = tokens.shape[1]
        cos = sequence_rows(cast(torch.Tensor, self.rope.cos), length)
        sin = sequence_rows(cast(torch.Tensor, self.rope.sin), length)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x if self.output is None else self.output(self.norm(x))


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def llama(
    shape: LlamaShape, *, seq_len: int = 8192, batch_size: int = 16, name: str = "llama"
) -> Workload:
    """A Llama-style workload of ``shape`` on the meta device (see the module doc)."""
    with torch.device("meta"):
        model = Llama(shape, seq_len)
    # parameters() counts a tied weight once; the head's matrix product counts either way.
    dense = sum(p.numel() for p in model.parameters()) - shape.vocab * shape.dim * (not shape.tied)
    head_dim = shape.dim // shape.heads
    # Training FLOPs per token: 6 per weight of the matrix products, 12 per attention score.
    per_token = 6 * dense + 12 * shape.layers * shape.heads * head_dim * seq_len
    return Workload(
        name=name,
        model=model,
        dataset=RandomTokens(seq_len, 1024, shape.vocab),
        loss=_loss,
        batch_size=batch_size,
        lr=3e-4,
        epochs=1,
        flops_per_sample=float(per_token * seq_len),
    )


def llama3_8b(
    seq_len: int = 8192, batch_size: int = 16, sizes: Mapping[str, Any] | None = None
) -> Workload:
    """Llama 3 8B's shape at ``seq_len`` tokens per sample, global ``batch_size``; ``sizes``
    changes fields of :class:`LlamaShape` (``{"layers": 2}`` for a test)."""
    shape = replaced(LlamaShape(), sizes or {})
    return llama(shape, seq_len=seq_len, batch_size=batch_size, name="llama3-8b")


def llama3_70b(
    seq_len: int = 8192, batch_size: int = 16, sizes: Mapping[str, Any] | None = None
) -> Workload:
    """Llama 3.1 70B's shape (80 blocks of width 8192, 64 query and 8 key/value heads, a
    feed-forward of 28672, the 128256-token vocabulary, untied: 7.06e10 parameters) on the meta
    device, at ``seq_len`` tokens per sample, global ``batch_size``; for planning (``gpukit plan
    --workload gpukit.workloads.llama:llama3_70b --layout auto``).

    >>> round(sum(p.numel() for p in llama3_70b().model.parameters()) / 1e9, 1)
    70.6
    """
    shape = LlamaShape(dim=8192, layers=80, heads=64, kv_heads=8, hidden=28672)
    return llama(
        replaced(shape, sizes or {}), seq_len=seq_len, batch_size=batch_size, name="llama3.1-70b"
    )


def llama3_405b(
    seq_len: int = 8192, batch_size: int = 16, sizes: Mapping[str, Any] | None = None
) -> Workload:
    """Llama 3.1 405B's shape (126 blocks of width 16384, 128 query and 8 key/value heads, a
    feed-forward of 53248, the 128256-token vocabulary, untied: 4.06e11 parameters) on the meta
    device, at ``seq_len`` tokens per sample, global ``batch_size``; for planning.

    >>> round(sum(p.numel() for p in llama3_405b(sizes={"layers": 1}).model.parameters()) / 1e9, 2)
    7.39
    """
    shape = LlamaShape(dim=16384, layers=126, heads=128, kv_heads=8, hidden=53248)
    return llama(
        replaced(shape, sizes or {}), seq_len=seq_len, batch_size=batch_size, name="llama3.1-405b"
    )


def llama3_2_1b(
    seq_len: int = 2048, batch_size: int = 4, sizes: Mapping[str, Any] | None = None
) -> Workload:
    """Llama 3.2 1B's shape (16 blocks of width 2048, 32 query and 8 key/value heads, a
    feed-forward of 8192, the 128256-token vocabulary, the head tied to the embedding: 1.24e9
    parameters) at ``seq_len`` tokens per sample, global ``batch_size``: a model one GPU trains.
    ``sizes`` changes fields of :class:`LlamaShape`: a CPU test runs a few narrow layers. (A
    mapping, not keywords: ``load_workload`` hands ``seed=`` to a function that takes any
    keyword, and a meta-device model has no weights to seed.)

    >>> round(sum(p.numel() for p in llama3_2_1b().model.parameters()) / 1e9, 2)
    1.24
    >>> small = llama3_2_1b(seq_len=32, sizes={"layers": 2, "dim": 64, "heads": 4,
    ...                     "kv_heads": 2, "hidden": 128, "vocab": 512})
    >>> len(small.model.layers), small.model.output.weight.shape
    (2, torch.Size([512, 64]))
    """
    shape = LlamaShape(dim=2048, layers=16, heads=32, kv_heads=8, hidden=8192, tied=True)
    return llama(
        replaced(shape, sizes or {}), seq_len=seq_len, batch_size=batch_size, name="llama3.2-1b"
    )
