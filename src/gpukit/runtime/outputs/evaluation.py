"""Evaluation in the program's own loop: ``rt.gather_for_metrics``, ``rt.pad_across_processes``
and ``with rt.evaluating(model):``.

Split over N ranks, a loader's pass hands every rank as many samples, so its sampler repeats a
few samples when N does not divide the dataset (see :mod:`gpukit.runtime.data.padding`): 513
samples on 2 ranks are 514 in the pass. ``rt.gather_for_metrics(x)`` joins every rank's rows of
``x`` on the first dimension and leaves those repeats out, so every sample counts exactly once
and a metric equals the one-process program's. It knows where the repeats are from the loader
that handed out the last batch: each batch handed out is noted here (no read, no collective).

>>> import torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu")
>>> model = torch.nn.Linear(2, 1)
>>> model, loader = rt.setup(model, DataLoader(TensorDataset(torch.ones(5, 2)), batch_size=2))
>>> rows = 0
>>> with rt.evaluating(model):
...     for (x,) in loader:
...         rows += len(rt.gather_for_metrics(model(x)))
>>> rows, model.training
(5, True)
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from gpukit._util.text import described, type_name
from gpukit._util.tree import is_dataclass_instance, leaves, map_tensors
from gpukit.errors import ConfigError, warn_user
from gpukit.runtime.data import padding
from gpukit.runtime.data.padding import BatchRows
from gpukit.strategies import Strategy, collectives


class _LeafKind(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Tensor) or not (
            isinstance(obj, list | tuple | Mapping) or is_dataclass_instance(obj)
        )


class _Leaf(metaclass=_LeafKind):
    """What the walk stops at: a tensor, or anything that is not a container (a number, None,
    and what is refused: a string, a NumPy array, any other object)."""


_LEAVES = _Leaf


class Evaluation:
    """The Runtime's ``rt.gather_for_metrics``, ``rt.pad_across_processes`` and
    ``rt.evaluating``: collectives over ``strategy`` (the Runtime gives it the new one when
    ``strategy="auto"`` replaces it), each after ``before_collective`` (the Runtime joins its
    process group and says where it is), and which rows of the batch each loader handed out
    last are the sampler's repeats (noted as they are handed out)."""

    def __init__(self, strategy: Strategy, before_collective: Callable[[], None]) -> None:
        self.strategy, self.before_collective = strategy, before_collective
        self.latest: BatchRows | None = None  # the batch a loader of this Runtime handed out last
        self.per_loader: dict[int, BatchRows] = {}

    def batch_handed(self, loader: Any, position: int, batch: Any) -> None:
        """A loader handed out the ``position``-th batch of its pass (called by the loader)."""
        before = self.per_loader.get(id(loader)) if position > 1 else None
        earlier = 0 if position == 1 else (before.pass_rows if before is not None else None)
        try:
            rows = padding.describe(loader, position, batch, earlier)
        except Exception:
            # A sampler or dataset whose length fails: bookkeeping never stops the loop, and
            # gathering then says it cannot tell the repeats.
            rows = BatchRows(None, None, 0, False, known=False)
        self.latest = self.per_loader[id(loader)] = rows

    def gather_for_metrics(self, data: Any) -> Any:
        """Every rank's ``data`` joined, each sample once: tensors (alone, or in dicts, lists,
        tuples, namedtuples, dataclasses) concatenated on their first dimension in rank order,
        or, for a loader sharded by sample (a ``DistributedSampler``), interleaved back into the
        sampler's order (with ``shuffle=False``: the dataset's, as one process sees it). The
        samples the sampler repeated to even out the ranks in its last batch are left out: the
        first dimension must be the samples, of the batch the loader handed out last or of
        every batch of its pass so far. A Python number or a 0-d tensor is one value per rank:
        a list of numbers, or a 1-d tensor, one per rank (not trimmed: a warning says so when
        the batch held repeats). The first dimension may differ between ranks; dtypes and
        the other dimensions may not (``rt.pad_across_processes`` evens one out).

        Collective: every rank calls it. Under several processes it costs one small object
        exchange (torch's ``all_gather_object``: shapes, counts and numbers) and one
        ``all_gather`` per tensor; in one process, a copy of each tensor.

        >>> import torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> out = rt.gather_for_metrics({"pred": torch.ones(3), "n": 3})
        >>> out["pred"].shape, out["n"]
        (torch.Size([3]), [3])
        """
        self.before_collective()
        strategy = self.strategy
        found = leaves(data, _LEAVES)
        batch = self.latest
        mine: dict[str, Any] = {
            "shard": strategy.sampler_placement()[1],
            "batch": None if batch is None else tuple(vars(batch).values()),
            "leaves": [_describe(path, value) for path, value in found],
        }
        metas = strategy.all_gather_object(mine) if strategy.distributed else [mine]
        # Every verdict below is drawn from what all ranks sent: they raise together.
        _check_leaves(metas)
        # Ranks that split samples (context parallel) make them whole first: the rank kept
        # for each shard below then holds every token of its samples.
        found = leaves(strategy.whole_samples(data), _LEAVES)
        keep = _first_of_each_shard(metas)
        rows_of = [BatchRows(*m["batch"]) if m["batch"] is not None else None for m in metas]
        repeats = [r.padding if r is not None else 0 for r in rows_of]
        _warn_unknown(rows_of)
        results: list[Any] = []
        for i, (path, value) in enumerate(found):
            kind = metas[0]["leaves"][i][1]
            if kind == "none":
                results.append(None)
            elif kind == "number":
                results.append([metas[r]["leaves"][i][3] for r in keep])
                if any(repeats):
                    _warn_per_rank(path)
            elif value.dim() == 0:
                parts = collectives.gather_rows(strategy, value.reshape(1), [1] * len(metas))
                results.append(torch.cat([parts[r] for r in keep]))
                if any(repeats):
                    _warn_per_rank(path)
            else:
                rows = [m["leaves"][i][3][0] for m in metas]
                _check_rows(path, rows, rows_of, keep)
                parts = collectives.gather_rows(strategy, value, rows)
                results.append(_joined([parts[r] for r in keep], [rows_of[r] for r in keep]))
        answers = iter(results)
        return map_tensors(data, lambda _: next(answers), leaf=_LEAVES, alias=False)

    def pad_across_processes(
        self,
        tensor: torch.Tensor,
        dim: int = 0,
        pad_index: int | float = 0,
        pad_first: bool = False,
    ) -> torch.Tensor:
        """``tensor`` padded with ``pad_index`` along ``dim`` to the longest size any rank has
        there (at the start with ``pad_first``), so that ``rt.all_gather`` can stack it: e.g.
        generated token ids of different lengths. Collective (one small object exchange); in
        one process the tensor itself.

        >>> import torch, gpukit as gk
        >>> gk.Runtime(devices="cpu").pad_across_processes(torch.ones(2, 3), dim=1).shape
        torch.Size([2, 3])
        """
        self.before_collective()
        return collectives.pad_across(self.strategy, tensor, dim, pad_index, pad_first)

    @contextlib.contextmanager
    def evaluating(self, *models: nn.Module) -> Iterator[None]:
        """Evaluate ``models`` (what ``rt.setup`` returned, or any module): each in eval mode
        (dropout off, batch norm on its running statistics) under ``torch.no_grad()``; on
        leaving, even by an error, every submodule is back in the mode it had.

        ``no_grad`` rather than ``inference_mode``: outputs made here may be kept and used
        later (a cache, a target, a tensor the training reads), which inference tensors refuse.

        >>> import torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
        >>> with rt.evaluating(model):
        ...     print(model.training, torch.is_grad_enabled())
        False False
        >>> model.training
        True
        """
        if not models:
            raise ConfigError(
                "rt.evaluating() got no model: name the models to evaluate, e.g. "
                "`with rt.evaluating(model):` or `with rt.evaluating(encoder, decoder):`"
            )
        for m in models:
            if not isinstance(m, nn.Module):
                raise ConfigError(
                    f"rt.evaluating got {described(m)}: give the models (torch.nn.Module, as "
                    "rt.setup returned them) to put in eval mode, e.g. rt.evaluating(model)"
                )
        modes = [(sub, sub.training) for m in models for sub in m.modules()]
        try:
            for m in models:
                m.eval()
            with torch.no_grad():
                yield
        finally:
            for sub, training in modes:
                sub.training = training


def _describe(path: str, value: Any) -> tuple[Any, ...]:
    """What the other ranks need to know of one leaf (its values travel apart, but a number's)."""
    if isinstance(value, torch.Tensor):
        return (path, "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape))
    if isinstance(value, numbers.Real):
        return (path, "number", type(value).__name__, value)
    if value is None:
        return (path, "none", "NoneType", None)
    return (path, "other", type_name(value), None)


def _check_leaves(metas: list[dict[str, Any]]) -> None:
    for rank, meta in enumerate(metas):
        for path, kind, name, _ in meta["leaves"]:
            if kind == "other":
                raise ConfigError(
                    f"rt.gather_for_metrics got a value of type {name} at {path} (rank {rank}): "
                    "it gathers "
                    "tensors and real numbers; make the value a tensor (e.g. torch.as_tensor, "
                    "or an index into your dataset for a name) or leave it out"
                )
    first = [_signature(leaf) for leaf in metas[0]["leaves"]]
    for rank, meta in enumerate(metas[1:], start=1):
        other = [_signature(leaf) for leaf in meta["leaves"]]
        if other == first:
            continue
        if [s[0] for s in other] != [s[0] for s in first]:
            raise ConfigError(
                "rt.gather_for_metrics got data of different structures on rank 0 "
                f"({', '.join(s[0] for s in first) or 'nothing'}) and rank {rank} "
                f"({', '.join(s[0] for s in other) or 'nothing'}): give every rank the same "
                "names and nesting"
            )
        a = next(a for a, b in zip(first, other, strict=True) if a != b)
        shown = f"rank 0: {_shown(metas[0], a[0])}, rank {rank}: {_shown(meta, a[0])}"
        raise ConfigError(
            f"rt.gather_for_metrics got {a[0]} of different dtypes or shapes beyond the first "
            f"dimension ({shown}): only the first dimension (the samples) may differ; pad the "
            f"others first, e.g. rt.pad_across_processes(x, dim=1)"
        )


def _signature(leaf: tuple[Any, ...]) -> tuple[Any, ...]:
    path, kind, name, value = leaf
    if kind != "tensor":
        return (path, kind)
    return (path, kind, name, len(value), tuple(value[1:]))


def _shown(meta: dict[str, Any], path: str) -> str:
    _, kind, name, value = next(leaf for leaf in meta["leaves"] if leaf[0] == path)
    return f"{name} {value}" if kind == "tensor" else f"a {name}"


def _first_of_each_shard(metas: list[dict[str, Any]]) -> list[int]:
    """The ranks whose data counts: ranks that read the same shard (tensor parallelism) hold
    the same samples, taken once, from the first of them."""
    seen: set[int] = set()
    keep = []
    for rank, meta in enumerate(metas):
        if meta["shard"] not in seen:
            seen.add(meta["shard"])
            keep.append(rank)
    return keep


def _check_rows(
    path: str, rows: list[int], batches: list[BatchRows | None], keep: list[int]
) -> None:
    for rank in keep:
        b = batches[rank]
        if b is None or not b.padding or rows[rank] in (b.rows, b.pass_rows):
            continue
        raise ConfigError(
            f"rt.gather_for_metrics got {path} with {rows[rank]} rows on rank {rank}, whose "
            f"last batch held {b.rows} samples ({b.padding} of them repeated by the sampler to "
            "even out the ranks, to be left out): give tensors whose first dimension is the "
            "batch's samples (or all samples of the pass so far), e.g. per-sample losses "
            "rather than tokens flattened across the batch"
        )


def _joined(parts: list[torch.Tensor], batches: list[BatchRows | None]) -> torch.Tensor:
    """The kept ranks' rows, each sample once, in the sampler's order where it is known."""
    repeats = [b.padding if b is not None else 0 for b in batches]
    rows = [len(p) for p in parts]
    if _interleaves(rows, batches, repeats):
        # Row i of rank r is sample i*N + r; the repeats are the whole pass's last samples.
        every = torch.stack(parts, dim=1).reshape(-1, *parts[0].shape[1:])
        return every[: len(every) - sum(repeats)]
    return torch.cat([p[: len(p) - min(k, len(p))] for p, k in zip(parts, repeats, strict=True)])


def _interleaves(rows: list[int], batches: list[BatchRows | None], repeats: list[int]) -> bool:
    if len(rows) < 2 or len(set(rows)) != 1:
        return False
    for n, b in zip(rows, batches, strict=True):
        if b is None or not b.strided or n not in (b.rows, b.pass_rows):
            return False
    # The repeated samples are the last of the pass only when they end the last ranks' rows.
    flags = [k > 0 for k in repeats]
    return all(k <= 1 for k in repeats) and flags == sorted(flags)


_warned: set[str] = set()


def _warn_per_rank(path: str) -> None:
    if path in _warned:
        return
    _warned.add(path)
    warn_user(
        f"rt.gather_for_metrics got {path}, one value per rank, in a batch where the sampler "
        "repeated samples to even out the ranks: a count or mean over that batch includes them. "
        "Gather per-sample values (e.g. (pred == y) rather than (pred == y).sum()) so that "
        "each sample counts once"
    )


def _warn_unknown(batches: list[BatchRows | None]) -> None:
    if len(batches) < 2 or "unknown" in _warned or all(b is None or b.known for b in batches):
        return
    _warned.add("unknown")
    warn_user(
        "rt.gather_for_metrics: the loader's sampler shards by rank in its own way, so gpukit "
        "cannot tell which samples it repeated to even out the ranks; every row is kept"
    )
