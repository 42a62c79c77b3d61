"""What fsdp refuses to shard, and why, before torch would fail later or train wrongly: a
model without parameters, a parameter without a dimension, a tie split across groups."""

from __future__ import annotations

from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies._recompute import refuse_reentrant


def shardable(module: nn.Module) -> nn.Module:
    """``module``, or the error that says why fsdp cannot shard it."""
    if not any(True for _ in module.parameters()):
        raise ConfigError(
            "fsdp: the model has no parameters, so there is nothing to shard: use "
            "strategy='ddp' or 'single'"
        )
    refuse_reentrant(module)
    scalars = [n for n, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ConfigError(
            f"fsdp cannot shard a parameter with no dimension ({', '.join(scalars[:5])}): "
            "sharding splits dimension 0 across the ranks. Make each a 1-element tensor "
            "(nn.Parameter(torch.tensor([2.0])) instead of torch.tensor(2.0); it "
            "broadcasts the same), or use strategy='ddp'"
        )
    return module


def refuse_split_ties(module: nn.Module) -> None:
    """A model the user sharded in part: a parameter that a sharded group took over but a
    module outside it still holds was tied across groups. ``fully_shard`` replaced it only in
    the group's module, so the tie is already broken, and torch would say so only at the first
    forward (or, with a tie it cannot see, train the two copies apart)."""
    split = [
        name
        for name, p in module.named_parameters()
        if not is_dtensor(p) and hasattr(p, "_fsdp_orig_uid")  # torch marks what it sharded
    ]
    if split:
        raise split_tie(", ".join(split), "its other user was sharded by fully_shard")


def split_tie(names: str, said: str) -> ConfigError:
    return ConfigError(
        f"fsdp: {names} shares a parameter with a module that is already sharded in another "
        f"group ({said}). Tied parameters (an output layer tied to its embedding) must be "
        "sharded in one group: let gpukit choose the groups (do not call fully_shard yourself "
        "on one of them), or call fully_shard([embedding, head]) on both together"
    )
