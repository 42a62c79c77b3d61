"""Class targets checked before the first step, while a bad label is still a readable error and
not a device-side assert that leaves CUDA unusable.

>>> import torch
>>> check_targets(torch.zeros(2, 3), torch.tensor([0, 2]))   # in range: nothing happens
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from gpukit._util.fake import has_values, real_tensors
from gpukit._util.text import explained as _say
from gpukit.diagnostics.trace import untraced
from gpukit.errors import ConfigError
from gpukit.strategies.per_device import PerDevice


def _class_count(outputs: Any, targets: torch.Tensor) -> int | None:
    # Where the class dimension is, judged by shapes; None when they fit neither layout.
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
    if not has_values(targets):
        return  # meta or fake (the planner's) tensors: no values to check
    classes = _class_count(outputs, targets)
    if classes is None or classes < 2:
        return  # one output: a binary or regression head, not class indices
    # Real targets are checked as real tensors even under the planner's fake tensors.
    with real_tensors():
        t = targets.detach().long()
        bad = ((t < 0) | (t >= classes)) & (t != ignore_index)
        kept = torch.where(bad, t, torch.zeros_like(t))
        with untraced():  # this one read is gpukit's own, not the user's line's
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


# Losses whose integer targets index classes: on a GPU a target out of range is a device-side
# assert. Other losses (binary, regression, the user's own functions) are never checked.
_CLASS_LOSSES = (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)
_CLASS_FUNCTIONS = (torch.nn.functional.cross_entropy, torch.nn.functional.nll_loss)


def with_target_check(
    loss: object, criterion: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """``criterion`` (what the strategy made of ``loss``) with a check of the targets on its
    first call, when ``loss`` is a class-index loss: ``nn.CrossEntropyLoss``/``nn.NLLLoss``
    or ``F.cross_entropy``/``F.nll_loss``, also through ``functools.partial``. A loss module
    that is its own criterion gets a forward pre-hook that removes itself (the module comes
    back as it was); otherwise a wrapper checks the whole batch's outputs and targets (under
    dp-balanced, before they are cut), with ``ignore_index`` from the loss, the partial or the
    call. Anything else comes back as is.

    >>> ce = torch.nn.CrossEntropyLoss()
    >>> with_target_check(ce, ce) is ce
    True
    """
    if isinstance(loss, _CLASS_LOSSES):
        if criterion is loss:
            _check_on_first_forward(loss)
            return criterion
        bound = {"ignore_index": loss.ignore_index}
    else:
        target = getattr(loss, "func", loss)  # functools.partial(F.cross_entropy, ...)
        if not any(target is f for f in _CLASS_FUNCTIONS):
            return criterion
        bound = dict(getattr(loss, "keywords", None) or {})
    checked = [False]

    @functools.wraps(criterion)
    def first_call_checked(outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> Any:
        if not checked[0]:
            checked[0] = True
            ignore = kwargs.get("ignore_index", bound.get("ignore_index", -100))
            check_targets(outputs, targets, ignore_index=int(ignore))
        return criterion(outputs, targets, *args, **kwargs)

    return first_call_checked


def _check_on_first_forward(loss: torch.nn.Module) -> None:
    def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        if len(args) >= 2:
            check_targets(args[0], args[1], ignore_index=int(getattr(module, "ignore_index", -100)))

    handle = loss.register_forward_pre_hook(check, with_kwargs=True)
