"""Which samples of a loader's batch a sharding sampler added as padding.

Split over N ranks, a pass must give every rank as many samples, so a ``DistributedSampler``
(and gpukit's ``Strided``, for other samplers) pads the list of n items to a multiple of N by
repeating its first items, then hands rank r the items at r, r+N, r+2N... The repeated items
sit at positions n, n+1, ... of the padded list: the last item of every rank r with
``r + (m-1)N >= n`` (m items per rank), that is ranks ``n % N`` to ``N-1`` when N does not
divide n, whether the list was shuffled or not (shuffling happens before padding). With
``drop_last=True`` the sampler cuts instead of padding: nothing is repeated.

Accelerate's order (``gpukit.runtime.data.dealing.Dealt``) deals whole batches instead, and
fills the last round up from the start of the pass: there the padding is the end of each
rank's last batch.

:func:`describe` tells, for the batch a loader just handed out, how many samples it holds,
how many the pass has handed out so far, and how many at its end are padding (only ever in a
pass's last batch), so that ``rt.gather_for_metrics`` counts every sample exactly once.

>>> from torch.utils.data import DistributedSampler
>>> [trailing_padding(DistributedSampler(range(513), 2, r, shuffle=False)) for r in (0, 1)]
[0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.utils.data import DistributedSampler

from gpukit._util.tree import tensors
from gpukit.runtime.data.dealing import Dealt
from gpukit.runtime.data.sampling import Strided, shards_by_rank


@dataclass(frozen=True)
class BatchRows:
    """The batch a loader handed out last, as ``rt.gather_for_metrics`` needs it.

    ``rows``: its samples on this rank; ``pass_rows``: samples the pass has handed out so far,
    this batch included (None when unknown); ``padding``: how many of its last samples the
    sampler added (0 but in a pass's last batch); ``strided``: sample i of this rank's pass is
    sample ``i*N + rank`` of the whole pass (a sharding sampler over single indices), so rows
    of all ranks interleave back into the sampler's order; ``known``: False for a sampler that
    shards by rank in a way gpukit cannot see (it cannot tell its padding).
    """

    rows: int | None
    pass_rows: int | None
    padding: int
    strided: bool
    known: bool = True


def trailing_padding(sampler: Any) -> int | None:
    """How many of the items ``sampler`` hands this rank each pass are padding (they are the
    last ones); None for a sampler that shards by rank in a way not known here."""
    if isinstance(sampler, DistributedSampler):
        n = len(sampler.dataset)  # type: ignore[arg-type]  # DistributedSampler needs a len
        replicas, rank, mine = sampler.num_replicas, sampler.rank, sampler.num_samples
    elif isinstance(sampler, Strided):
        n, replicas, rank, mine = (
            len(sampler.inner),
            sampler.num_replicas,
            sampler.rank,
            len(sampler),
        )
    elif isinstance(sampler, Dealt):
        return sampler.trailing_padding()
    elif shards_by_rank(sampler):
        return None
    else:
        return 0  # one shard: nothing repeated
    real = min(mine, max(0, -(-(n - rank) // replicas)))  # items at positions < n
    return mine - real


def describe(loader: Any, position: int, batch: Any, pass_rows: int | None) -> BatchRows:
    """The :class:`BatchRows` of the ``position``-th batch (from 1) of a pass of ``loader`` (a
    ``DeviceLoader``); ``pass_rows``: the samples its earlier batches held (None: unknown),
    counted by the caller where they are not known from the sampler."""
    sampler, rebuilt = loader.sampler, loader.loader
    if sampler is None:  # an iterable dataset: no sampler, no padding
        rows = _leading_rows(batch)
        return BatchRows(rows, _add(pass_rows, rows), 0, False)
    by_batch = rebuilt.batch_size is None
    known = not shards_by_rank(sampler) or isinstance(sampler, DistributedSampler | Strided)
    try:
        batches, mine = len(rebuilt), len(sampler)
    except TypeError:  # a sampler with no length, in one process
        rows = _leading_rows(batch)
        return BatchRows(rows, _add(pass_rows, rows), 0, False)
    last = position == batches
    # Padding is only ever in a pass's last batch: only there is it worked out.
    pad = trailing_padding(sampler) if last else 0
    if by_batch:
        rows = _leading_rows(batch)
        padding = rows if pad and rows is not None else 0
        if isinstance(sampler, Dealt):  # a last batch filled up in part, when that is known
            padding = min(pad or 0, rows or 0)
            known = sampler.trailing_padding() is not None
        return BatchRows(rows, _add(pass_rows, rows), padding, False, known)
    size = int(rebuilt.batch_size)
    rows = max(0, min(size, mine - (position - 1) * size))
    padding = 0
    if pad and (not rebuilt.drop_last or mine % size == 0):
        padding = min(pad, rows)  # the pass's last samples are in its last batch
    strided = isinstance(sampler, DistributedSampler | Strided) and sampler.num_replicas > 1
    return BatchRows(rows, min(mine, position * size), padding, strided, known)


def _leading_rows(batch: Any) -> int | None:
    first = next(tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else None


def _add(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b
