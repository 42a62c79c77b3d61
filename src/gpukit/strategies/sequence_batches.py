"""Sequences split across context-parallel ranks, the causal work balanced between them.

Under context parallelism (``cp`` ranks) every rank of a cp group reads the same samples and
keeps a part of each sequence. Causal attention costs more at the end of a sequence (each
token attends to all before it), so a rank does not take one contiguous piece: the sequence is
cut into ``2 * cp`` chunks and rank ``i`` takes chunks ``i`` and ``2 * cp - 1 - i``, one cheap
and one dear, and every rank does the same work. Inputs and targets are split alike (every
tensor of a batch with a sequence dimension), so each rank's loss is the mean over its own
tokens; with equal tokens per rank the gradient average over the ranks is the mean over all.

A model that computes its positions (``arange(T)`` for position embeddings or rotary angles)
must ask for them with :func:`sequence_positions`: under context parallelism its ``T`` local
tokens are not the sequence's first ``T``.

>>> shards = SequenceShards(size=2, rank=1)
>>> shards.chunks(), shards.positions(4).tolist()
((1, 2), [2, 3, 4, 5])
>>> x = torch.arange(8).view(1, 8)
>>> shards.local(x).tolist()
[[2, 3, 4, 5]]
>>> sequence_positions(4).tolist()  # no context parallelism here: arange
[0, 1, 2, 3]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gpukit._util.tree import map_tensors
from gpukit.errors import ConfigError

SEQUENCE_DIM = 1  # batches are batch-first: (batch, sequence, ...)


@dataclass(frozen=True)
class SequenceShards:
    """This rank's part of every sequence: ``size`` context-parallel ranks, this one the
    ``rank``-th among them."""

    size: int
    rank: int

    def chunks(self) -> tuple[int, int]:
        """The two of the sequence's ``2 * size`` chunks this rank holds, in order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def check_length(self, length: int, what: str = "a batch's sequence") -> None:
        """Refuse a whole sequence ``length`` that does not split into ``2 * size`` chunks."""
        if length % (2 * self.size):
            raise ConfigError(
                f"context parallel cp={self.size}: {what} has {length} tokens, which do not "
                f"split into {2 * self.size} equal chunks (cp ranks take 2 each, so that "
                f"causal attention costs them alike): use a sequence length divisible by "
                f"{2 * self.size}, e.g. {length - length % (2 * self.size)}"
            )

    def local(self, tensor: torch.Tensor, dim: int = SEQUENCE_DIM) -> torch.Tensor:
        """This rank's part of ``tensor``, whose ``dim`` is a whole sequence."""
        length = tensor.shape[dim]
        self.check_length(length)
        chunk = length // (2 * self.size)
        first, second = self.chunks()
        return torch.cat(
            (tensor.narrow(dim, first * chunk, chunk), tensor.narrow(dim, second * chunk, chunk)),
            dim=dim,
        )

    def batch(self, batch: Any) -> Any:
        """``batch`` with every tensor of two or more dimensions (``(batch, sequence, ...)``)
        cut to this rank's part; tensors of one value per sample pass as they are."""
        return map_tensors(batch, lambda t: self.local(t) if t.dim() > SEQUENCE_DIM else t)

    def whole(self, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        """``tensor``, this rank's part of whole sequences along dimension 1, made whole from
        every rank's part (an all-gather over ``group``, the cp ranks, in rank order)."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=group)
        order = torch.argsort(self.gathered_positions(tensor.shape[SEQUENCE_DIM], tensor.device))
        return torch.cat(parts, dim=SEQUENCE_DIM).index_select(SEQUENCE_DIM, order)

    def positions(self, length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The positions in the whole sequence of this rank's ``length`` local tokens."""
        if length % 2:
            raise ConfigError(
                f"context parallel cp={self.size}: a rank's {length} local tokens are not two "
                "equal chunks: give sequence_positions the local length the rank holds"
            )
        chunk = length // 2
        first, second = self.chunks()
        return torch.cat(
            (
                torch.arange(first * chunk, (first + 1) * chunk, device=device),
                torch.arange(second * chunk, (second + 1) * chunk, device=device),
            )
        )

    def gathered_positions(self, length: int, device: torch.device | str | None) -> torch.Tensor:
        """Where each token of the ranks' local parts, concatenated in rank order (what an
        all-to-all gathers), sits in the whole sequence; ``length``: one rank's local tokens."""
        return torch.cat(
            [SequenceShards(self.size, r).positions(length, device) for r in range(self.size)]
        )


# The shards of the model forward running now (a stack: a forward may call another model).
# None: a whole_sequences() block, where positions are arange again.
_running: list[SequenceShards | None] = []


def enter(shards: SequenceShards) -> None:
    """Start a forward under ``shards``: what :func:`sequence_positions` answers from."""
    _running.append(shards)


def leave() -> None:
    """End the forward :func:`enter` started."""
    _running.pop()


# Depth of whole_sequences() blocks: context-parallel forwards inside take whole sequences.
_whole: list[None] = []


@contextlib.contextmanager
def whole_sequences() -> Iterator[None]:
    """Inside, a context-parallel model's forward takes whole sequences, as without context
    parallelism: every rank computes the whole forward (its attention over the sequence it
    was given, its positions ``arange``). For a few small forwards (writing a sample, a
    check) that every rank makes together: the weights are still gathered from the ranks.
    Elsewhere it changes nothing.

    >>> import gpukit as gk
    >>> with gk.whole_sequences():
    ...     gk.sequence_positions(3).tolist()
    [0, 1, 2]
    """
    _whole.append(None)
    _running.append(None)
    try:
        yield
    finally:
        _running.pop()
        _whole.pop()


def taking_whole() -> bool:
    """Whether forwards now take whole sequences (inside :func:`whole_sequences`)."""
    return bool(_whole)


def sequence_positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the ``length`` tokens a model's forward holds:
    ``arange(length)``, except inside a forward under context parallelism
    (``gk.strategies.Parallel(cp=...)``), where they are this rank's tokens' places in the
    whole sequence. Use it wherever a model computes ``arange`` over its sequence (position
    embeddings, rotary angles).

    >>> import gpukit as gk
    >>> gk.sequence_positions(3).tolist()
    [0, 1, 2]
    """
    shards = _running[-1] if _running else None
    if shards is None:
        return torch.arange(length, device=device)
    return shards.positions(length, device)


def sequence_rows(table: torch.Tensor, length: int) -> torch.Tensor:
    """The rows of a per-position ``table`` (rotary angles by position) for the forward's
    ``length`` tokens: ``table[:length]``, a view, as a model without context parallelism
    takes them; inside a context-parallel forward, the rows of this rank's tokens.

    >>> sequence_rows(torch.arange(6.0).view(6, 1), 2).tolist()
    [[0.0], [1.0]]
    """
    shards = _running[-1] if _running else None
    if shards is None:
        return table[:length]
    return table[shards.positions(length, table.device)]


__all__ = [
    "SequenceShards",
    "enter",
    "leave",
    "sequence_positions",
    "sequence_rows",
    "taking_whole",
    "whole_sequences",
]
