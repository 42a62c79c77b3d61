"""Accelerate's data order, for ``gk.Runtime(data_order="accelerate")``: whole batches dealt to
the ranks in turn.

A program moved from Accelerate keeps its numbers only if every rank sees the batches it saw
there, and the global random generator is drawn from as it was. Under N ranks Accelerate does
not give a shuffled loader a ``DistributedSampler`` (gpukit's default order, ``"torch"``):

- at set-up, a sampler with a ``generator`` attribute left None (``shuffle=True``'s
  ``RandomSampler``) gets a generator of its own, seeded with one int64 drawn from the global
  generator, loader after loader in the order they are set up (the user's sampler keeps it, as
  under Accelerate); at the start of every pass rank 0's generator state is sent to the others;
- the loader's batch sampler runs whole on every rank, and its batches are dealt: rank r
  takes batches r, r+N, r+2N... A round that not every rank can fill is, with
  ``even_batches=True``, completed by items taken again from the start of the pass (the short
  last batch first filled up, then whole batches, until every rank has one), or left to the
  ranks that have a batch in it with ``even_batches=False``; a batch sampler with
  ``drop_last`` drops it;
- with ``split_batches=True`` every batch is cut into N equal pieces instead, rank r taking the
  r-th (a short last batch is filled up from the start of the pass first, under
  ``even_batches``); the batch size must then divide by N;
- each batch is read one ahead of the one handed out (Accelerate's loader looks ahead to know
  the last), which matters where reading a sample draws random numbers;
- a dataset with ``set_epoch`` is told each pass's epoch as the pass starts, unless the
  sampler is told instead (:func:`dataset_told_epoch`), in one process too.

In one process Accelerate changes nothing else (no draw, no dealing): neither does gpukit.

>>> from torch.utils.data import BatchSampler, SequentialSampler
>>> batches = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
>>> [list(Dealt(batches, 2, rank)) for rank in (0, 1)]
[[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
>>> fours = BatchSampler(SequentialSampler(range(10)), batch_size=4, drop_last=False)
>>> [list(Dealt(fours, 2, rank, split_batches=True)) for rank in (0, 1)]
[[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import BatchSampler, DataLoader

from gpukit._util.text import described, type_name
from gpukit.errors import ConfigError

DataOrderName = Literal["torch", "accelerate"]
# Rank 0's tensor, on every rank (the Runtime's broadcast).
Share = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DataOrder:
    """How a loader's passes are ordered and shared among the ranks: ``name`` ("torch": a
    ``DistributedSampler`` seeded with ``seed``; "accelerate": :class:`Dealt`), Accelerate's two
    options, and ``share`` (rank 0's tensor on every rank) for its per-pass generator sync."""

    name: DataOrderName = "torch"
    seed: int = 0
    even_batches: bool = True
    split_batches: bool = False
    share: Share | None = None

    @property
    def reads_ahead(self) -> bool:
        """Each batch is read one ahead of the one handed out, as Accelerate's loader does."""
        return self.name == "accelerate"

    def batches_per_step(self, num_ranks: int) -> int:
        """How many of a loader's own batches ``num_ranks`` ranks take together per step: one
        each, or one in all where ``split_batches`` cuts every batch into a piece per rank (the
        global batch is then the loader's own, and Accelerate's scheduler steps once a call).

        >>> split = DataOrder("accelerate", split_batches=True)
        >>> DataOrder().batches_per_step(4), split.batches_per_step(4)
        (4, 1)
        """
        return 1 if self.name == "accelerate" and self.split_batches else num_ranks


def data_order(settings: Any, share: Share | None) -> DataOrder:
    """The :class:`DataOrder` of a Runtime's settings (``data_order``, ``seed``: None is 0,
    ``even_batches``, ``split_batches``: None is Accelerate's default)."""
    return DataOrder(
        settings.data_order,
        settings.seed or 0,
        settings.even_batches is not False,
        settings.split_batches is True,
        share,
    )


def dealt(loader: DataLoader[Any], num_ranks: int, rank: int, order: DataOrder) -> Dealt:
    """The batches rank ``rank`` of ``num_ranks`` takes from ``loader``'s passes, as Accelerate
    prepares it: its sampler given a generator drawn from the global one first (see the module
    docstring). Draws now, once per loader: call it where Accelerate's ``prepare`` would."""
    # A DataLoader given a BatchSampler as its sampler (batch_size=None) batches by it.
    batches: Any = loader.sampler if isinstance(loader.sampler, BatchSampler) else None
    batches = batches if batches is not None else loader.batch_sampler
    sampler: Any = getattr(batches, "sampler", None)
    if hasattr(sampler, "generator") and sampler.generator is None:
        made = torch.Generator(device=torch.get_default_device())
        made.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        sampler.generator = made
    generator = getattr(sampler, "generator", None)
    return Dealt(
        batches,
        num_ranks,
        rank,
        even_batches=order.even_batches,
        split_batches=order.split_batches,
        generator=generator if isinstance(generator, torch.Generator) else None,
        share=order.share,
    )


def dataset_told_epoch(loader: DataLoader[Any], num_ranks: int) -> Any:
    """``loader``'s dataset where Accelerate's prepared loader calls its ``set_epoch(epoch)``
    as each pass starts, else None. It tells the dataset unless it tells a sampler with a
    ``set_epoch`` instead: on several ranks, the sampler inside the batch sampler it deals
    from; in one process, none (the dataset is told beside the sampler). A ``BatchSampler``
    given as the loader's sampler leaves it nothing to tell but the dataset."""
    if not callable(getattr(loader.dataset, "set_epoch", None)):
        return None
    if not isinstance(loader.sampler, BatchSampler):
        # Accelerate looks for the sampler one level inside the batch sampler it iterates:
        # on several ranks that is its shard around the loader's batch sampler.
        inside = loader.batch_sampler
        dealt_from = inside if num_ranks > 1 else getattr(inside, "batch_sampler", None)
        if hasattr(getattr(dealt_from, "sampler", None), "set_epoch"):
            return None
    return loader.dataset


class Dealt:
    """Rank ``rank``'s batches of every pass of the batch sampler ``batches`` (see the module
    docstring). ``synchronize()``, at each pass's start, gives every rank rank 0's state of
    ``generator`` (the sampler's), where ``share`` is given.

    Its ranks are not named ``num_replicas``/``rank``: it does not shard a sampler's indices,
    it deals whole batches (``gpukit.runtime.data.padding`` tells its padding apart).
    """

    def __init__(
        self,
        batches: Any,
        num_ranks: int,
        rank: int,
        even_batches: bool = True,
        split_batches: bool = False,
        generator: torch.Generator | None = None,
        share: Share | None = None,
    ) -> None:
        self.inner = batches
        self.num_ranks, self.index = num_ranks, rank
        self.even_batches, self.split_batches = even_batches, split_batches
        self.batch_size: int | None = getattr(batches, "batch_size", None)
        self.drop_last = bool(getattr(batches, "drop_last", False))
        self.generator = generator
        self._share = share
        if split_batches and (self.batch_size is None or self.batch_size % num_ranks):
            raise ConfigError(
                f"split_batches=True cuts each batch into {num_ranks} equal pieces, one per "
                f"rank, but the loader's batch size is {self.batch_size}: use a batch_size "
                f"that divides by {num_ranks}, or split_batches=False (whole batches dealt "
                "to the ranks in turn)"
            )

    def synchronize(self) -> None:
        """Rank 0's generator state on every rank (a collective: every rank's pass calls it)."""
        if self.generator is not None and self._share is not None:
            self.generator.set_state(self._share(self.generator.get_state()))

    @property
    def epoch(self) -> int | None:
        """The epoch of the sampler inside, where it has one (a ``DistributedSampler``)."""
        return getattr(getattr(self.inner, "sampler", None), "epoch", None)

    def set_epoch(self, epoch: int) -> None:
        """Passed on to the sampler inside, as Accelerate's loader does at every pass."""
        sampler: Any = getattr(self.inner, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        total, n = len(self.inner), self.num_ranks
        if self.split_batches or total % n == 0:
            return total if self.split_batches else total // n
        if self.drop_last:
            return total // n
        if self.even_batches:
            return total // n + 1
        return total // n + (1 if self.index < total % n else 0)

    def __iter__(self) -> Iterator[Any]:
        return self._pieces() if self.split_batches else self._whole()

    def _full(self, batch: Any) -> bool:
        # Without a batch size (a batch sampler of varying sizes) every batch counts as full.
        return self.batch_size is None or len(batch) == self.batch_size

    def _check_listed(self, batch: Any, index: int) -> None:
        # Every rank runs the whole batch sampler, so every rank stops at the same batch: none
        # goes on alone to wait for the others in its next collective.
        if not isinstance(batch, list):
            raise ConfigError(
                f"data_order='accelerate': the loader's {type_name(self.inner)} yielded "
                f"{described(batch)} as batch {index} of the pass, not a list of indices. "
                "Accelerate's order deals, pads and cuts batches as lists: make it yield "
                "lists (a tensor's .tolist()), or use data_order='torch'"
            )

    def _whole(self) -> Iterator[Any]:
        n, me = self.num_ranks, self.index
        head: list[Any] = []  # the pass's first n batches: what a last round is padded from
        mine: Any = None  # this rank's batch in the round under way
        index, last = -1, None
        for index, batch in enumerate(self.inner):
            self._check_listed(batch, index)
            if index < n and not self.drop_last:
                head.append(batch)
            if index % n == me:
                mine = batch
            # A round is handed out once its last batch has come, and is full (only a pass's
            # last batch is short): before that, no rank knows that every rank has one.
            if index % n == n - 1 and self._full(batch):
                yield mine
                mine = None
            last = batch
        if self.drop_last or not head:
            return
        if not self.even_batches:
            if mine is not None and len(mine) > 0:
                yield mine
            return
        if mine is not None and len(mine) > 0 and self._full(mine):
            yield mine
        yield from self._padding(head, index, last)

    def _padding(self, head: list[Any], index: int, last: Any) -> Iterator[Any]:
        """The batches that complete the pass's last round, made from its first items again
        (its first batches when they have no fixed size); the short last batch, if any, is
        filled up first and stays at its place."""
        n, me, size = self.num_ranks, self.index, self.batch_size
        pool: list[Any] = list(head) if size is None else [i for b in head for i in b]
        while len(pool) < (n if size is None else n * size):  # fewer items than one round
            pool += pool
        if self._full(last):
            index, last = index + 1, []
        taken = 0
        while index % n or last:
            if size is None:
                batch, taken = pool[taken], taken + 1
            else:
                wanted = size - len(last)
                batch, taken = list(last) + pool[taken : taken + wanted], taken + wanted
            if index % n == me:
                yield batch
            index, last = index + 1, []

    def _pieces(self) -> Iterator[Any]:
        size = int(self.batch_size or 0)
        piece = size // self.num_ranks
        mine = slice(piece * self.index, piece * (self.index + 1))
        first: Any = None
        last: Any = None
        for index, batch in enumerate(self.inner):
            self._check_listed(batch, index)
            first = batch if first is None else first
            if len(batch) == size:
                yield batch[mine]
            last = batch
        if self.drop_last or first is None or len(first) == 0 or len(last) >= size:
            return
        if not self.even_batches:
            if len(last) > mine.start:
                yield last[mine]
            return
        pool = list(first)
        while len(pool) < size:
            pool += pool
        yield (list(last) + pool)[mine]

    def trailing_padding(self) -> int | None:
        """How many samples of this rank's last batch of a pass were taken again from the
        start of the pass (None without a fixed batch size)."""
        size, sampler = self.batch_size, getattr(self.inner, "sampler", None)
        if size is None or not isinstance(sampler, Sized):
            return None
        if self.drop_last or not self.even_batches:
            return 0
        dataset = len(sampler)
        total, n = len(self.inner), self.num_ranks
        if self.split_batches:
            piece = size // n
            end = (total - 1) * size + piece * (self.index + 1)
            return max(0, min(piece, end - dataset))
        rounds = -(-total // n)
        end = ((rounds - 1) * n + self.index + 1) * size  # items up to this rank's last batch
        return max(0, min(size, end - dataset))
