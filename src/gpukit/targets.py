"""Class targets checked before the first step, while a bad label is still a readable error and
not a device-side assert that leaves CUDA unusable.

>>> import torch
>>> check_targets(torch.zeros(2, 3), torch.tensor([0, 2]))   # in range: nothing happens
"""

from __future__ import annotations

from typing import Any

import torch

from gpukit._format import explained as _say
from gpukit.errors import ConfigError


def _class_count(outputs: Any, targets: torch.Tensor) -> int | None:
    # Where the class dimension is, judged by shapes; None when they fit neither layout.
    from gpukit.strategies.dp import PerDevice  # late: strategies may import this module

    if isinstance(outputs, PerDevice):
        if not outputs.outputs or not isinstance(outputs.outputs[0], torch.Tensor):
            return None
        first = outputs.outputs[0]
        shape = (sum(outputs.sizes), *first.shape[1:])  # the whole batch, as targets have it
    elif isinstance(outputs, torch.Tensor):
        first, shape = outputs, tuple(outputs.shape)
    else:
        return None  # a tuple or dict of outputs: which one meets the targets is unknown
    if not first.is_floating_point() or len(shape) < 2:
        return None
    t = tuple(targets.shape)
    if len(t) == len(shape) - 1 and t[0] == shape[0] and t[1:] == shape[2:]:
        return int(shape[1])  # (N, C, d1, ...) with (N, d1, ...): cross_entropy's layout
    if t == shape[:-1]:
        return int(shape[-1])  # (B, T, C) with (B, T): a sequence model's logits
    return None


def check_targets(outputs: Any, targets: Any, *, ignore_index: int = -100) -> None:
    """Raise :class:`~gpukit.errors.ConfigError` when integer class targets fall outside
    ``[0, num_classes)`` (``ignore_index`` aside), with ``num_classes`` read from the outputs'
    shape: dim 1 for ``(N, C, ...)`` outputs with ``(N, ...)`` targets, the last dim for
    ``(B, T, C)`` outputs with ``(B, T)`` targets. Floating targets, outputs in a tuple or dict
    and shapes that fit neither layout are not checked. Reads the targets back once (one sync).

    >>> logits = torch.zeros(3, 5)
    >>> check_targets(logits, torch.tensor([0, 4, -100]))   # fine
    >>> check_targets(logits, torch.tensor([0, 7, 2]))
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: targets hold 7 but the model has 5 classes (valid 0..4): ...
    """
    if not isinstance(targets, torch.Tensor) or targets.numel() == 0:
        return
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        return  # regression targets or soft labels: nothing to index with
    if targets.device.type == "meta":
        return
    classes = _class_count(outputs, targets)
    if classes is None or classes < 1:
        return
    t = targets.detach().long()
    bad = ((t < 0) | (t >= classes)) & (t != ignore_index)
    kept = torch.where(bad, t, torch.zeros_like(t))
    count, low, high = torch.stack([bad.sum(), kept.min(), kept.max()]).tolist()
    if count == 0:
        return
    # kept holds 0 where a target is fine, so low < 0 and high >= classes only for bad ones.
    held = " and ".join([str(low)] * (low < 0) + [str(high)] * (high >= classes))
    what = (
        f"targets hold {held} but the model has {classes} classes (valid 0..{classes - 1}): "
        f"{count} of {t.numel()} targets are out of range"
    )
    why = (
        "on a GPU this is a device-side assert (Assertion `t >= 0 && t < n_classes` failed) "
        "that leaves CUDA unusable; on the CPU an IndexError in the loss"
    )
    fixes = [
        "check the dataset's labels: they must be 0-based class indices (labels 1..C need y - 1)"
    ]
    if high >= classes:
        fixes.append(f"check the output layer's size: it must be at least {high + 1}")
    if low < 0:
        fixes.append(
            f"only ignore_index ({ignore_index}) may be negative: if the loss ignores another "
            "value, pass it as ignore_index"
        )
    raise ConfigError(_say(what, why, fixes))


class CheckedCriterion:
    """A loss function whose first call checks the targets (see :func:`check_targets`); later
    calls go straight through. ``ignore_index`` is taken from the loss when it has one.

    >>> crit = CheckedCriterion(torch.nn.CrossEntropyLoss())
    >>> float(crit(torch.zeros(2, 3), torch.tensor([0, 2]))) > 0
    True
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        bound = getattr(fn, "keywords", None) or {}  # functools.partial(F.cross_entropy, ...)
        self.ignore_index = int(getattr(fn, "ignore_index", bound.get("ignore_index", -100)))
        self.checked = False

    def __call__(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.checked:
            self.checked = True
            check_targets(outputs, targets, ignore_index=self.ignore_index)
        return self.fn(outputs, targets, *args, **kwargs)
