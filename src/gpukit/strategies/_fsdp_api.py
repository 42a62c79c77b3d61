"""torch's FSDP2 pieces, wherever this torch keeps them.

torch 2.6 made ``fully_shard`` public under ``torch.distributed.fsdp``; 2.4 and 2.5 kept it
under ``torch.distributed._composable.fsdp``. Older releases have no FSDP2: asking for fsdp
there is a ConfigError that says which version it needs.
"""

from __future__ import annotations

from typing import Any

import torch

from gpukit.errors import ConfigError


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
