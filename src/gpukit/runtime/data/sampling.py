"""Which sampler a loader iterates with, and how one pass of it starts.

A loader keeps the user's sampler when it is already right for this process: always in one
process (so a ``RandomSampler`` draws its order from the global generator exactly as with
plain PyTorch), and under several processes when it already shards by rank (a
``DistributedSampler`` or any sampler with ``num_replicas`` and ``rank``). Otherwise, under
several processes:

- a plain shuffle (``shuffle=True``/``False``) becomes a ``DistributedSampler`` with the run's
  seed, keeping shuffle; it pads the list to a multiple of N as Lightning's does, and the
  loader's ``drop_last`` then drops a short last batch of each rank;
- any other sampler or ``batch_sampler`` with a length is sharded as Lightning does with custom
  samplers: each pass lists its items and rank r takes items r, r+N, r+2N... (padded like a
  ``DistributedSampler``, so every rank runs as many batches). Every rank must then draw the
  same list, which gpukit's seeding gives (``Runtime(seed=...)`` seeds every rank alike);
- a sampler without a length cannot be sharded evenly and is refused.

:class:`PassSampler` wraps whichever is used, so a pass can skip the batches a resumed run has
already trained on, and can make the sampler's own random draws at a chosen moment.

>>> from torch.utils.data import SequentialSampler
>>> sampler = PassSampler(SequentialSampler(range(5)))
>>> sampler.begin(skip=2)
>>> list(sampler)
[2, 3, 4]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from gpukit.errors import ConfigError

_END = object()


def shards_by_rank(sampler: Any) -> bool:
    """Whether ``sampler`` already hands each rank its own part (DistributedSampler's API)."""
    return hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")


def is_plain_shuffle(sampler: Any) -> bool:
    """What ``shuffle=True`` or ``shuffle=False`` makes: a permutation, or the dataset's order.
    A RandomSampler with replacement or a set number of samples is neither."""
    if isinstance(sampler, SequentialSampler):
        return True
    return (
        isinstance(sampler, RandomSampler)
        and not sampler.replacement
        and sampler._num_samples is None
    )


def check_rank_sampler(sampler: Any, num_shards: int, shard: int) -> None:
    """Refuse a rank-sharding sampler built for another rank or world size."""
    replicas, rank = sampler.num_replicas, sampler.rank
    if (replicas, rank) != (num_shards, shard):
        raise ConfigError(
            f"the loader's {type(sampler).__name__} was built for rank {rank} of {replicas}, "
            f"but this process is rank {shard} of {num_shards}: build it with "
            "num_replicas=rt.world_size, rank=rt.rank, or without them after gk.Runtime(...) "
            "(which joins the process group)"
        )


def distributed(loader: DataLoader[Any], num_shards: int, shard: int, seed: int) -> Sampler[int]:
    """The DistributedSampler that replaces a plain shuffle under several processes."""
    dataset_size = len(loader.dataset)  # type: ignore[arg-type]  # map-style: it has a len
    if dataset_size < num_shards:
        raise ConfigError(
            f"the dataset has {dataset_size} samples, fewer than the {num_shards} ranks: "
            "every rank needs at least one; use fewer devices or more data"
        )
    return DistributedSampler(
        loader.dataset,
        num_replicas=num_shards,
        rank=shard,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=seed,
        # Padded, never cut: the loader's own drop_last drops a short last batch afterwards,
        # as under PyTorch's DDP recipe and Lightning, whose ranks then see these batches.
        drop_last=False,
    )


class Strided(Sampler[Any]):
    """Rank ``rank``'s share of every pass of ``inner``: items rank, rank+N, ... after padding
    the list (or cutting it, with ``drop_last``) to a multiple of N."""

    def __init__(self, inner: Any, num_replicas: int, rank: int, drop_last: bool) -> None:
        if not isinstance(inner, Sized):
            raise ConfigError(
                f"cannot shard a loader's {type(inner).__name__} over {num_replicas} ranks: it "
                "has no length, so the ranks could run different numbers of steps and wait on "
                "each other forever. Give it __len__, or make it shard by rank itself "
                "(num_replicas=rt.world_size, rank=rt.rank)"
            )
        if len(inner) < num_replicas:
            raise ConfigError(
                f"the loader's {type(inner).__name__} yields {len(inner)} items, fewer than the "
                f"{num_replicas} ranks: every rank needs at least one; use fewer devices"
            )
        self.inner: Any = inner
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last

    def __len__(self) -> int:
        n = len(self.inner)
        return n // self.num_replicas if self.drop_last else math.ceil(n / self.num_replicas)

    def __iter__(self) -> Iterator[Any]:
        items = list(self.inner)
        total = len(self) * self.num_replicas
        while len(items) < total:  # pad by repeating from the start, as DistributedSampler does
            items += items[: total - len(items)]
        return iter(items[self.rank : total : self.num_replicas])


class PassSampler(Sampler[Any]):
    """The sampler (or batch sampler) one loader pass draws from.

    ``begin(skip)`` starts a pass that drops its first ``skip`` items (indices, or batches for
    a batch sampler). ``draw_now()`` makes the inner sampler's own random draws at once (a
    RandomSampler draws its seed when its first item is asked for); the DataLoader's iterator
    then takes that already-started pass.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0
        self._started: Iterator[Any] | None = None
        self._opened = False

    def begin(self, skip: int) -> None:
        self.skip, self._started, self._opened = skip, None, False

    def draw_now(self) -> None:
        """Start this pass now, unless the DataLoader already did (worker prefetching)."""
        if not self._opened:
            self._started = self._open()

    def _open(self) -> Iterator[Any]:
        self._opened = True
        items = iter(self.inner)
        first = next(items, _END)
        started = iter(()) if first is _END else itertools.chain([first], items)
        return itertools.islice(started, self.skip, None)

    def __iter__(self) -> Iterator[Any]:
        # A generator, as a batch sampler's __iter__ usually is: the DataLoader calls iter()
        # on it before drawing its workers' base seed, and must not make our draws then.
        started, self._started = self._started, None
        yield from started if started is not None else self._open()

    def __len__(self) -> int:
        return len(self.inner)


def generators(loader: DataLoader[Any]) -> list[torch.Generator]:
    """The private generators a pass of ``loader`` may draw from (besides the global one)."""
    found: list[torch.Generator] = []
    candidates = [
        loader.generator,
        getattr(loader.sampler, "generator", None),
        getattr(getattr(loader.batch_sampler, "sampler", None), "generator", None),
        getattr(loader.batch_sampler, "generator", None),
        # The generator of a sampler gpukit wraps (Accelerate's order keeps its sampler's).
        getattr(getattr(loader.batch_sampler, "inner", None), "generator", None),
    ]
    # Then any sampler's own generator further inside (a sampler=RandomSampler(generator=g),
    # a batch sampler around one), after those, so the states saved before keep their places.
    candidates += _inner_generators([loader.sampler, loader.batch_sampler])
    for g in candidates:
        if isinstance(g, torch.Generator) and not any(g is f for f in found):
            found.append(g)
    return found


def _inner_generators(samplers: list[Any]) -> list[Any]:
    """The ``generator`` of each sampler in the chains from ``samplers`` inwards, following
    what gpukit's wrappers (``inner``) and a batch sampler (``sampler``) hold."""
    found: list[Any] = []
    seen: set[int] = set()
    while samplers:
        sampler = samplers.pop(0)
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        found.append(getattr(sampler, "generator", None))
        samplers += [getattr(sampler, "inner", None), getattr(sampler, "sampler", None)]
    return found
