"""Collectives over many tensors, one per bucket of consecutive tensors of one dtype and
device (as DDP's reducer groups gradients): rank 0's state broadcast, and gradients held back
from the reducer averaged by gpukit itself."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Tensors sent together in one collective: DDP's own reducer's default bucket size.
_BUCKET_BYTES = 25 * 2**20


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to ``limit`` bytes per group."""
    groups: list[list[torch.Tensor]] = []
    size = 0
    for g in tensors:
        current = groups[-1] if groups else None
        fits = current is not None and size + g.nbytes <= limit
        if not (fits and current[0].dtype == g.dtype and current[0].device == g.device):  # type: ignore[index]
            groups.append([g])
            size = g.nbytes
        else:
            current.append(g)  # type: ignore[union-attr]
            size += g.nbytes
    return groups


def _scatter_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def average(grads: list[torch.Tensor], world_size: int) -> None:
    """Average ``grads`` over the ranks in place, bucket by bucket, as DDP's reducer would:
    what out-of-memory recovery does once every rank has finished its backward."""
    for bucket in _buckets(grads, _BUCKET_BYTES):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        flat /= world_size
        _scatter_back(flat, bucket)


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite ``tensors`` in place with rank 0's, bucket by bucket (empty ones left out)."""
    with torch.no_grad():
        for bucket in _buckets([t for t in tensors if t.numel()], _BUCKET_BYTES):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src=0)
            _scatter_back(flat, bucket)
