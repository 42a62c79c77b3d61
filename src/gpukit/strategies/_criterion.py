"""The loss computed on every device: what makes ``dp-balanced`` balanced.

Called with a :class:`~gpukit.strategies.dp.PerDevice` output, the criterion cuts the targets
(and any extra batch-sized arguments) exactly as the inputs were cut, computes each device's loss
in its own thread, and combines the scalars on one device, each weighted by its share of the
batch. For a loss that is a mean over samples this gives exactly the mean over the whole batch,
even when the batch does not divide evenly. Called with anything else (one device, or outputs
already gathered) it is the plain loss function: the same call works for one device and many.

>>> import torch
>>> from gpukit.strategies.per_device import PerDevice
>>> cpu = torch.device("cpu")
>>> crit = ParallelCriterion(torch.nn.functional.l1_loss, cpu, "mean")
>>> out = PerDevice((torch.zeros(3), torch.zeros(1)), (cpu, cpu), (3, 1))
>>> crit(out, torch.tensor([1.0, 1.0, 1.0, 5.0]))
tensor(2.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies._parallel import parallel_apply, replicate, scatter
from gpukit.strategies.per_device import PerDevice, Reduction


class ParallelCriterion:
    """``fn(outputs, targets, *args, **kwargs)`` per device, reduced to one scalar.

    ``reduction`` says what ``fn`` returns: "mean" (the mean over its samples: losses are
    weighted by chunk size) or "sum" (losses are added). ``nn.Module`` losses with weights or
    parameters are replicated onto each device like the model.
    """

    def __init__(
        self, fn: Callable[..., torch.Tensor], loss_device: torch.device, reduction: Reduction
    ) -> None:
        self.fn = fn
        self.loss_device = loss_device
        self.reduction = reduction

    def __call__(self, outputs: Any, targets: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(outputs, PerDevice):
            return self.fn(outputs, targets, *args, **kwargs)
        devices = list(outputs.devices)
        pieces = scatter((targets, *args), kwargs, outputs.sizes, devices)
        inputs = [
            ((out, *chunk_args), chunk_kwargs)
            for out, (chunk_args, chunk_kwargs) in zip(outputs.outputs, pieces, strict=True)
        ]
        losses = parallel_apply(self._replicas(devices), inputs, devices)
        total = sum(outputs.sizes)
        combined: torch.Tensor | None = None
        for i, (loss, size) in enumerate(zip(losses, outputs.sizes, strict=True)):
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ConfigError(
                    f"the criterion returned {shape} on replica {i} ({devices[i]}), not a "
                    "scalar: dp-balanced needs one loss per device (use reduction='mean' or "
                    "'sum' in the loss function)"
                )
            weight = size / total if self.reduction == "mean" else 1.0
            term = loss.to(self.loss_device) * weight
            combined = term if combined is None else combined + term
        assert combined is not None  # at least one device
        return combined

    def _replicas(self, devices: list[torch.device]) -> list[Callable[..., torch.Tensor]]:
        fn = self.fn
        stateful = isinstance(fn, nn.Module) and any(
            True for _ in (*fn.parameters(), *fn.buffers())
        )
        if stateful:
            return list(replicate(fn, devices))  # type: ignore[arg-type]
        return [fn] * len(devices)


def reduction_of(fn: Callable[..., Any], given: str | None) -> Reduction:
    """How ``fn`` reduces over samples: ``given``, else an ``nn.Module`` loss's ``reduction``
    (or a ``functools.partial``'s ``reduction=``), else "mean"; "none" is refused (one scalar
    per device is needed). A plain function that sums must say so with ``reduction="sum"``."""
    bound = getattr(fn, "keywords", None) or {}  # functools.partial(F.cross_entropy, ...)
    found = given if given is not None else getattr(fn, "reduction", bound.get("reduction", "mean"))
    if found not in ("mean", "sum"):
        raise ConfigError(
            f"criterion reduction {described(found)}: the loss must reduce its samples to one "
            "number; use reduction='mean' (or 'sum'), e.g. nn.CrossEntropyLoss(reduction='mean')"
        )
    return found  # type: ignore[return-value]
