"""The data the planner's simulation trains on: the dataset's first item repeated, batched by
index without reading the items, and collated into fake tensors; only shapes matter to memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gpukit._util.fake import real_tensors
from gpukit._util.tree import map_tensors
from gpukit.errors import SimulationUnsupported


class Repeated(torch.utils.data.Dataset):
    """``length`` items, each the dataset's first: batches are stacked from items of one
    shape (gpukit train's default collation needs that too), and only shapes matter to
    memory. Long enough that every simulated step reads a full batch within one pass (a
    pass's end reads the logged values), and one item read however large the batch."""

    def __init__(self, dataset: Any, length: int) -> None:
        try:
            size = len(dataset)
        except TypeError:
            raise SimulationUnsupported(
                "the dataset has no length (an iterable dataset): the simulation reads its "
                "items by index"
            ) from None
        if size == 0:
            raise SimulationUnsupported("the dataset is empty: there is no batch to simulate")
        self.item, self.length = dataset[0], max(size, length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.item

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self.item] * len(indices)


class SameBatches:
    """A batch sampler: ``count`` batches of ``size`` indices (all the repeated item's)."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count

    def __iter__(self) -> Iterator[list[int]]:
        return ([0] * self.size for _ in range(self.count))

    def __len__(self) -> int:
        return self.count


class FakeCollate:
    """The default collation's result as fake tensors: for each tensor of an item, one new
    tensor of the items stacked, as ``torch.stack`` makes, without reading the items (a batch
    of any size costs no memory or time here; the loader itself runs with real tensors, see
    :func:`rank_batches`)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode

    def __call__(self, items: list[Any]) -> Any:
        # Every item is the repeated first one: its tensors, each stacked len(items) times.
        with self.mode:
            return map_tensors(
                items[0],
                lambda t: torch.empty((len(items), *t.shape), dtype=t.dtype, device=t.device),
            )


def rank_batches(loader: Any, per_step: int) -> Iterator[Any]:
    """One rank's batches from gpukit's own loader, as ``gpukit train`` reads them: the
    shuffle, the sampler's shard and the loader's seed are values, drawn with real tensors;
    the batches themselves are collated into fake ones. ``per_step`` is the samples one
    optimizer step of one rank reads, for the message when a pass holds fewer."""
    with real_tensors():
        batches = iter(loader)
    while True:
        with real_tensors():
            batch = next(batches, None)
        if batch is None:
            raise SimulationUnsupported(
                f"one optimizer step of one rank needs {per_step} "
                "samples, more than one pass over the dataset holds: give a smaller "
                "micro-batch or accumulation"
            )
        yield batch
