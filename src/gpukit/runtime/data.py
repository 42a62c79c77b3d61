"""A device-aware wrapper around a DataLoader.

It shards the data across ranks (a ``DistributedSampler`` that keeps the user's shuffle,
drop_last and the run's seed), starts each pass with ``set_epoch`` so the order changes every
epoch, remembers where it is inside an epoch so a resumed run continues with the next batch,
and hands out batches already on the device. On CUDA it pins host memory and copies the next
batch on a side stream while the current one is being used.

>>> import torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu")
>>> loader = rt.setup_loader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
>>> [batch[0].tolist() for batch in loader]
[[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from gpukit._util.tree import tensors
from gpukit.devices.move import move_to
from gpukit.errors import ConfigError

# The DataLoader arguments carried over when the loader is rebuilt around a new sampler.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
)


class _ResumableSampler(Sampler[int]):
    """A DistributedSampler whose first ``skip`` indices can be dropped for one pass."""

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner) - self.skip


class DeviceLoader:
    """Iterate like the wrapped DataLoader; see the module docstring for what it adds.

    ``epoch`` counts finished passes and ``position`` the batches handed out in the current
    one; both are saved in checkpoints.
    """

    def __init__(
        self, loader: DataLoader[Any], device: torch.device, num_shards: int, shard: int, seed: int
    ) -> None:
        self.device = device
        self._generator: torch.Generator | None = None
        self.epoch = 0
        self.position = 0
        self._sampler: _ResumableSampler | None = None
        self.loader = self._with_sharded_sampler(loader, num_shards, shard, seed)

    def _with_sharded_sampler(
        self, loader: DataLoader[Any], num_shards: int, shard: int, seed: int
    ) -> DataLoader[Any]:
        if isinstance(loader.dataset, IterableDataset):
            return loader  # an iterable dataset shards itself, if at all
        sampler = loader.sampler
        custom = loader.batch_sampler if loader.batch_size is None else sampler
        # A RandomSampler drawing with replacement or a set number of samples is not a
        # permutation, which is what a DistributedSampler shards: treat it as custom.
        plain_random = (
            isinstance(custom, RandomSampler)
            and not custom.replacement
            and (custom._num_samples is None)
        )
        if not (plain_random or isinstance(custom, SequentialSampler)):
            if num_shards > 1:
                raise ConfigError(
                    f"cannot shard a DataLoader with a custom sampler ({type(custom).__name__}) "
                    f"over {num_shards} ranks: use shuffle=True/False and batch_size, or make "
                    "the sampler shard by rank itself"
                )
            return loader
        dataset_size = len(loader.dataset)  # type: ignore[arg-type]
        if dataset_size < num_shards:
            raise ConfigError(
                f"the dataset has {dataset_size} samples, fewer than the {num_shards} ranks: "
                "every rank needs at least one; use fewer devices or more data"
            )
        # Even one process gets a DistributedSampler: its order depends only on (seed, epoch),
        # which is what makes a resumed run see exactly the batches the first run would have.
        inner: DistributedSampler[Any] = DistributedSampler(
            loader.dataset,
            num_replicas=num_shards,
            rank=shard,
            shuffle=isinstance(sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
        )
        self._sampler = _ResumableSampler(inner)
        options = {name: getattr(loader, name) for name in _CARRIED}
        # Each new iterator draws a base seed for its workers; from the global RNG that draw
        # would shift the random stream at every epoch start, so a resumed run (which starts an
        # iterator mid-epoch) would drift. Our own generator, reseeded per epoch, does not.
        self._seed = seed
        if options["generator"] is None:
            options["generator"] = self._generator = torch.Generator()
        if options["num_workers"] == 0:
            options.pop("persistent_workers")
        if loader.prefetch_factor is not None and options["num_workers"] > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        pin = loader.pin_memory or self.device.type == "cuda"
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=self._sampler,
            pin_memory=pin,
            **options,
        )

    @property
    def sampler(self) -> DistributedSampler[Any] | None:
        """The sharding sampler, or None when the user's loader was kept as is."""
        return self._sampler.inner if self._sampler is not None else None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if self._sampler is not None:
            self._sampler.inner.set_epoch(self.epoch)
            self._sampler.skip = self.position * int(self.loader.batch_size or 1)
            if self._generator is not None:
                self._generator.manual_seed(self._seed * 1_000_003 + self.epoch)
            batches: Iterator[Any] = iter(self.loader)
        else:  # no sampler of ours: skip a resumed epoch's first batches by reading them
            batches = itertools.islice(iter(self.loader), self.position, None)
        moved = (
            self._prefetched(batches)
            if self.device.type == "cuda"
            else (move_to(b, self.device) for b in batches)
        )
        for batch in moved:
            self.position += 1
            yield batch
        self.epoch += 1
        self.position = 0
        if self._sampler is not None:
            self._sampler.skip = 0

    def _prefetched(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Copy batch i+1 on a side stream while batch i is used on the current stream."""
        stream = torch.cuda.Stream(self.device)

        def start_copy(batch: Any) -> Any:
            with torch.cuda.stream(stream):
                return move_to(batch, self.device, non_blocking=True)

        pending = None
        for batch in batches:
            following = start_copy(batch)
            if pending is not None:
                yield _ready(pending, stream)
            pending = following
        if pending is not None:
            yield _ready(pending, stream)


def _ready(batch: Any, copy_stream: torch.cuda.Stream) -> Any:
    """Make the current stream wait for the copy, and tell the allocator the tensors are now
    used there, so their memory is not handed out again while kernels still read it."""
    current = torch.cuda.current_stream(copy_stream.device)
    current.wait_stream(copy_stream)
    for t in tensors(batch):  # every tensor of any batch structure the copy made
        t.record_stream(current)
    return batch
