"""The validation pass of ``gpukit train``: the held-out loss (and accuracy) of the model as it
stands, over every rank's share of the validation set, each sample counted exactly once.

Each rank takes the samples ``shard, shard + shards, ...`` of the set (``shards`` the number of
data shards, as the training loader has them: tensor-parallel ranks read the same ones): no
sample is repeated to even the shares out, as a ``DistributedSampler`` would. Every rank runs
the same number of forwards (a forward may gather weights from every rank, as under fsdp): a
rank's share is cut into as many batches as the largest share needs, and a rank left with
nothing for a batch runs it on one sample that it does not count. The sums of the losses
(each batch's mean times its samples), of the correct predictions and of the samples are
added over the ranks in one ``all_reduce`` and read back once.

The pass leaves the training as it was: the model runs in eval mode under ``no_grad`` and each
module gets its own mode back; the items are read and stacked here, without a DataLoader (an
iteration of one draws a seed from the global RNG), so no random stream moves.

>>> import torch, gpukit as gk
>>> rt = gk.Runtime(devices="cpu")
>>> data = torch.utils.data.TensorDataset(torch.eye(3), torch.tensor([0, 1, 1]))
>>> model = torch.nn.Identity()
>>> result = evaluate(rt, model, torch.nn.functional.cross_entropy, data, 2, accuracy=True)
>>> result["val_accuracy"], round(result["val_loss"], 4)
(0.6666666666666666, 0.8848)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from gpukit.devices import to
from gpukit.runtime.runtime import Runtime
from gpukit.strategies import PerDevice


def evaluate(
    rt: Runtime,
    model: nn.Module,
    criterion: Callable[[Any, Any], torch.Tensor],
    dataset: Dataset[Any],
    batch_size: int,
    *,
    accuracy: bool = False,
) -> dict[str, float]:
    """``val_loss`` (the mean over the samples of ``criterion(model(x), y)``) and, with
    ``accuracy``, ``val_accuracy`` over all of ``dataset``; every rank must call it together.

    ``model`` and ``criterion`` are those ``rt.setup`` and ``rt.setup_criterion`` returned (the
    run's precision and strategy evaluate, as they train); ``batch_size`` is the most samples
    one forward gets on a rank."""
    shards, shard = rt.strategy.sampler_placement()
    size = len(dataset)  # type: ignore[arg-type]
    share = list(range(shard, size, shards))
    largest = -(-size // shards)
    batches = _cut(share, max(1, -(-largest // batch_size)))
    # loss sum, correct-prediction sum, sample count: float64, exact for any count and
    # well past float32's rounding for the sums.
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            for part in batches:
                counted = len(part)
                batch = to(default_collate([dataset[i] for i in part or [0]]), rt.device)
                # This rank's part, as the training loader hands it (context parallel: its
                # chunks of every sequence; each rank's loss is the mean over its tokens).
                x, y = rt.strategy.local_batch(batch)
                out = model(x)
                if not counted:  # the forward other ranks need; nothing of it counts
                    continue
                totals[0] += criterion(out, y).detach().double() * counted
                if accuracy:
                    logits = out.gather() if isinstance(out, PerDevice) else out
                    hits = (logits.argmax(dim=-1) == y.to(logits.device)).double().mean()
                    totals[1] += hits.to(totals.device) * counted
                totals[2] += counted
    finally:
        for module, training in modes:
            module.train(training)
    loss_sum, hit_sum, count = rt.all_reduce(totals, "sum").tolist()  # the pass's one read
    result = {"val_loss": loss_sum / count}
    if accuracy:
        result["val_accuracy"] = hit_sum / count
    return result


def _cut(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` runs of sizes that differ by one at most (some may be empty).

    >>> _cut([1, 2, 3, 4, 5], 2), _cut([7], 3)
    ([[1, 2, 3], [4, 5]], [[7], [], []])
    """
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
