"""torch's FSDP2 pieces, wherever this torch keeps them.

torch 2.6 made ``fully_shard`` public under ``torch.distributed.fsdp``; 2.4 and 2.5 kept it
under ``torch.distributed._composable.fsdp``. Older releases have no FSDP2: asking for fsdp
there is a ConfigError that says which version it needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies.pipeline_split import StagesView


def fsdp2() -> Any:
    """The module holding ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy`` and
    ``CPUOffloadPolicy``."""
    try:
        import torch.distributed.fsdp as public

        if hasattr(public, "fully_shard"):
            return public
        import torch.distributed._composable.fsdp as composable

        return composable
    except ImportError:
        raise ConfigError(
            f"strategy 'fsdp' needs torch 2.4 or newer (FSDP2's fully_shard); this is "
            f"torch {torch.__version__}: upgrade torch, or use strategy='ddp'"
        ) from None


def dtensor_class() -> type | None:
    """``DTensor`` (public from torch 2.5), or None where this torch has none."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (a sharded parameter, gradient or state)."""
    cls = dtensor_class()
    return cls is not None and isinstance(value, cls)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` (or a module inside it) was sharded by fsdp."""
    try:
        cls = fsdp2().FSDPModule
    except ConfigError:
        return False
    if isinstance(module, StagesView):  # pipeline stages on one rank, each an fsdp root
        return any(is_sharded(stage) for stage in module.stages)
    return any(isinstance(m, cls) for m in module.modules())


def inside_wrappers(module: nn.Module) -> nn.Module:
    """The user's model inside gpukit's own thin wrappers (mixed precision's autocast module).
    It is the root that fsdp shards, so that calling it directly (a sample, an evaluation
    through ``rt.unwrap(model)``) gathers the root's weights too."""
    while getattr(module, "gpukit_thin_wrapper", False):
        module = next(module.children())
    return module


def outermost(module: nn.Module, cls: type) -> list[Any]:
    """The modules of class ``cls`` in ``module`` that no other one of them contains."""
    if isinstance(module, cls):
        return [module]
    return [found for child in module.children() for found in outermost(child, cls)]
