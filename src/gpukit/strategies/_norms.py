"""The total gradient norm, and clipping by it, when gradients are sharded over several device
meshes (fsdp x tensor parallel: the split layers' weights live on the 2-D mesh, the rest on
the data-parallel one).

torch's ``clip_grad_norm_`` stacks every parameter's norm into one tensor, which DTensors on
different meshes refuse. Here the gradients are grouped by mesh and placement, each group's
norm is completed across its ranks (one small all-reduce per group, no read), and the groups'
norms combine as one norm. Clipping then scales each rank's local shards by the same factor.

>>> import torch
>>> grads = [torch.tensor([3.0]), torch.tensor([4.0])]
>>> float(total_norm(grads))
5.0
>>> float(clip(grads, 1.0)), [round(float(g), 4) for g in grads]
(5.0, [0.6, 0.8])
"""

from __future__ import annotations

from typing import Any

import torch

from gpukit.strategies._fsdp_api import is_dtensor


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together, as a plain tensor on their device."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        key = (id(g.device_mesh), tuple(g.placements)) if is_dtensor(g) else None  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(g)
    parts = []
    for members in groups.values():
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(members)))
        parts.append(norm.full_tensor() if is_dtensor(norm) else norm)
    if not parts:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([p.to(parts[0].device) for p in parts]))


def clip(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place to a total norm of at most ``max_norm`` (as torch's
    ``clip_grad_norm_`` does: by ``max_norm / (norm + 1e-6)``, never up); the norm before."""
    norm = total_norm(grads)
    scale(grads, norm, max_norm)
    return norm


def scale(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (norm + 1e-6)``, never up (``norm``: their
    total norm, however it was found)."""
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    local = [g.to_local() if is_dtensor(g) else g for g in grads]  # type: ignore[attr-defined]
    if local:
        torch._foreach_mul_(local, factor.to(local[0].device))
