"""What a loader must give to train on: at least one batch on this rank."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from gpukit.errors import ConfigError


def check_has_batches(given: DataLoader[Any], sharded: DataLoader[Any], shards: int) -> None:
    """Refuse a loader that yields no batch: its training loop would run no step and the run
    would end "done" with nothing trained. A loader without a length (an iterable dataset
    without ``__len__``, a stream) is not checked: only iterating it would tell.

    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> empty = DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4)
    >>> check_has_batches(empty, empty, 1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: rt.setup got a DataLoader with no batches: its dataset is empty ...
    """
    try:
        batches, mine = len(given), len(sharded)
        # The ignore: a Dataset declares no __len__; one without it raises TypeError here.
        samples: int | None = len(given.dataset)  # type: ignore[arg-type]
    except TypeError:
        return
    if batches and mine:
        return
    size = given.batch_size
    if not samples:
        why = "its dataset is empty (0 samples): check the path, split or filter that built it"
    elif batches == 0 and size is not None and given.drop_last:
        why = (
            f"its dataset has {samples} samples, fewer than batch_size={size}, and "
            "drop_last=True drops them all: use a smaller batch_size, or drop_last=False"
        )
    elif batches == 0:
        why = "its sampler yields no indices: check the sampler given to the DataLoader"
    else:
        why = (
            f"split over {shards} ranks, {samples} samples ({batches} "
            f"batch{'es' if batches > 1 else ''} in one process) leave this rank none: use "
            "more samples, a smaller batch_size, or fewer ranks"
        )
    raise ConfigError(f"rt.setup got a DataLoader with no batches: {why}")
