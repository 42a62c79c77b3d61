"""DistributedDataParallel's memory without its reducer, for the planner's fake tensors.

DDP's C++ reducer reads parameter values when it is built (it checks shapes across ranks and
broadcasts rank 0's state), which fake tensors do not have. What it holds in memory is one
flat gradient bucket per group of parameters of one dtype: as many bytes as the gradients of
the parameters that train, kept for the whole run. The stand-in holds the same buckets and
otherwise runs the model as DDP does; everything else of the DDP strategy (its setup,
accumulation switches, loss placement) is gpukit's real code.

>>> import torch
>>> from torch import nn
>>> ddp = SimulatedDDP(nn.Linear(4, 2))
>>> sum(b.numel() for b in ddp.buckets), ddp(torch.ones(3, 4)).shape
(10, torch.Size([3, 2]))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# DDP's default bucket size (its bucket_cap_mb=25); its first bucket is 1 MiB.
_DEFAULT_BUCKET_MB = 25.0
# What DDP's constructor broadcasts at once (its broadcast_bucket_size).
_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class SimulatedDDP(DistributedDataParallel):
    """A model wrapped as DDP wraps it, holding DDP's gradient buckets (see the module doc)."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Any = None,
        *,
        bucket_cap_mb: float | None = None,
        **_options: Any,
    ) -> None:
        nn.Module.__init__(self)  # not DDP's: that one starts the reducer
        self.module = module
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.broadcast_buffers = True
        _broadcast_copies([*module.parameters(), *module.buffers()])
        cap = int((bucket_cap_mb or _DEFAULT_BUCKET_MB) * 1024 * 1024)
        self.buckets = _buckets([p for p in module.parameters() if p.requires_grad], cap)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)


def _broadcast_copies(tensors: list[torch.Tensor]) -> None:
    """What DDP's constructor makes while it broadcasts rank 0's parameters and buffers: one
    flat copy of each bucket of up to 250 MiB of one dtype, made and freed in turn (the peak
    of a model that trains few of its weights can be there)."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for t in tensors:
        chunks = groups.setdefault((t.dtype, t.device), [[]])
        if chunks[-1] and sum(c.nbytes for c in chunks[-1]) + t.nbytes > _BROADCAST_BUCKET_BYTES:
            chunks.append([])
        chunks[-1].append(t)
    with torch.no_grad():
        for chunks in groups.values():
            for chunk in chunks:
                flat = torch.cat([t.detach().reshape(-1) for t in chunk])
                del flat


def _buckets(params: list[nn.Parameter], cap: int) -> list[torch.Tensor]:
    """Flat buckets in reverse parameter order (the order gradients arrive), split at ``cap``
    bytes and by dtype and device, as DDP's reducer lays them out."""
    out: list[torch.Tensor] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for p in reversed(params):
        key = (p.dtype, p.device)
        numel = open_.setdefault(key, [0])
        numel[0] += p.numel()
        if numel[0] * p.element_size() >= cap:
            out.append(torch.empty(numel[0], dtype=p.dtype, device=p.device))
            numel[0] = 0
    out += [torch.empty(n[0], dtype=k[0], device=k[1]) for k, n in open_.items() if n[0]]
    return out
