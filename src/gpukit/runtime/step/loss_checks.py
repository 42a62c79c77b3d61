"""What ``rt.backward`` and ``rt.train_step`` accept as a loss, and the error for anything else.

A loss must be one number that autograd can differentiate: a floating-point tensor with a
single element (shape ``()``, or ``(1,)`` as torch also allows), attached to the graph of the
model's parameters. Anything else would fail inside ``backward`` with torch's own message (or
an ``AttributeError`` for a Python float), which says little about the training loop that
produced it; a loss on the ``meta`` device would silently compute no gradient. The check reads
only metadata (``isinstance``, ``requires_grad``, ``dim()``, ``dtype``, ``is_meta``), never a
value on the device, so it costs nothing per step that matters: about 0.2 µs on the host, and
no wait for the device.

>>> import torch
>>> w = torch.ones(3, requires_grad=True)
>>> check_loss((w * 2).sum()) is not None
True
>>> check_loss((w * 2).sum().item())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
gpukit.errors.ConfigError: rt.backward(loss) got a float (6.0): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gpukit._util.text import described, safe_repr, type_name
from gpukit.errors import ConfigError

_NEED = "the loss must be a scalar floating-point tensor attached to the autograd graph"


def check_loss(loss: Any, where: str = "rt.backward(loss)") -> torch.Tensor:
    """``loss`` itself when ``backward`` can start from it; else a
    :class:`~gpukit.errors.ConfigError` saying what it was and how to make it a loss.
    ``where`` names the call in that message."""
    if (
        isinstance(loss, torch.Tensor)
        and loss.requires_grad
        and (loss.dim() == 0 or loss.numel() == 1)
        and loss.dtype.is_floating_point
        and not loss.is_meta
    ):
        return loss
    raise ConfigError(f"{where} got {_what(loss)}: {_NEED}; {_fix(loss)}")


def checked_loss_fn(
    compute_loss: Callable[[Any], Any],
    done: Callable[[Any], bool] = lambda loss: False,
) -> Callable[[Any], torch.Tensor]:
    """``compute_loss`` with :func:`check_loss` applied to what it returns, for
    ``rt.train_step``, except to a loss whose backward is ``done`` already (the strategy's
    ``backward_done``: a pipeline schedule's); a ``compute_loss`` that cannot be called is
    refused at once.

    >>> import torch
    >>> w = torch.ones(2, requires_grad=True)
    >>> checked_loss_fn(lambda batch: (w * batch).sum())(torch.ones(2))
    tensor(2., grad_fn=<SumBackward0>)
    """
    if not callable(compute_loss):
        raise ConfigError(
            f"rt.train_step(optimizer, batch, compute_loss) got compute_loss="
            f"{described(compute_loss)}: pass a function of one micro-batch that returns its "
            "mean loss, e.g. lambda b: F.cross_entropy(model(b[0]), b[1])"
        )

    def compute(batch: Any) -> torch.Tensor:
        loss = compute_loss(batch)
        return loss if done(loss) else check_loss(loss, "rt.train_step's compute_loss(batch)")

    return compute


def _what(loss: Any) -> str:
    """The loss described from its type and metadata (a tensor's values are never read)."""
    if not isinstance(loss, torch.Tensor):
        return "None" if loss is None else f"{_a(type_name(loss))} ({safe_repr(loss, 40)})"
    dtype = str(loss.dtype).removeprefix("torch.")
    shape = tuple(loss.shape)
    grad = "" if loss.requires_grad else " that does not require grad"
    return f"{_a(dtype)} tensor of shape {shape} on {loss.device}{grad}"


def _a(word: str) -> str:
    return f"an {word}" if word[:1].lower() in ("a", "e", "i", "o") else f"a {word}"


def _fix(loss: Any) -> str:
    if loss is None:
        return "return the loss from the function that computes it (`return loss`)"
    if isinstance(loss, (int, float)):
        return (
            "a Python number has no autograd graph, so no gradient can come from it: pass the "
            "loss tensor itself (do not call .item(), float() or .tolist() on it first)"
        )
    if isinstance(loss, (tuple, list, dict)):
        return "pass the loss tensor alone (e.g. `return loss`, not `return loss, logits`)"
    if not isinstance(loss, torch.Tensor):
        return "pass the tensor your loss function returns, e.g. F.cross_entropy(logits, y)"
    if loss.numel() != 1:
        return (
            f"it holds {loss.numel()} values: reduce it to one with .mean() (or .sum()), e.g. "
            "a loss module with reduction='mean' rather than 'none'"
        )
    if loss.is_meta:
        return (
            "a meta tensor has a shape but no values, so its backward computes nothing: "
            "build the model on a real device (rt.setup refuses one with meta parameters)"
        )
    if not loss.dtype.is_floating_point:
        return (
            "gradients need a floating-point loss: compute it from the model's float outputs "
            "(e.g. F.cross_entropy(logits, targets)), not from labels, argmax or a count"
        )
    return (
        "it has no autograd graph: it was computed under torch.no_grad() or "
        "torch.inference_mode(), detached (.detach(), .item()), or from a model whose "
        "parameters are all frozen; compute it from the model's output with grad enabled"
    )


__all__ = ["check_loss", "checked_loss_fn"]
