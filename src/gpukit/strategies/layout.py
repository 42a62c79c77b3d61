"""The sizes of a parallel layout's dimensions, checked before any process starts.

A layout names how many ranks each dimension of one device mesh takes, in torchtitan's order,
outermost first:

- ``pp``: pipeline stages (each rank holds some of the model's blocks);
- ``dp_replicate``: replicas of the sharded model (HSDP: gradients all-reduced across them);
- ``dp_shard``: ranks that shard weights, gradients and optimizer state (FSDP);
- ``cp``: ranks that split each sequence (context parallel; they shard the weights with
  ``dp_shard`` too, as torchtitan does);
- ``tp``: ranks that split each layer (tensor parallel).

One size may be ``-1``: it takes what the others leave of the job's ranks.

>>> Layout(tp=2, pp=2).resolved(8)
Layout(dp_replicate=1, dp_shard=2, tp=2, pp=2, cp=1)
>>> Layout(tp=2, pp=2).resolved(8).described()
'pp 2 x dp_shard 2 x tp 2'
>>> Layout(tp=3).resolved(8)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
gpukit.errors.ConfigError: parallel layout dp_shard -1 x tp 3 over 8 rank(s): ...
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from gpukit._util.text import described
from gpukit.errors import ConfigError

# Outermost first: the order of the mesh's dimensions, as torchtitan builds it (pipeline
# stages across nodes, tensor parallel within a node's fastest links).
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension takes (see the module docstring)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)) or value == 0:
                raise ConfigError(
                    f"parallel {name}={described(value)}: give a whole number of ranks, 1 or "
                    "more, or -1 for what the other dimensions leave"
                )
            if value < -1:
                raise ConfigError(
                    f"parallel {name}={value}: give 1 or more ranks, or -1 for what the other "
                    "dimensions leave"
                )
        free = [n for n in DIMS if getattr(self, n) == -1]
        if len(free) > 1:
            raise ConfigError(
                f"parallel layout: {' and '.join(free)} are both -1; only one dimension can "
                "take what the others leave: give the other a size"
            )

    @classmethod
    def of(cls, sizes: dict[str, Any]) -> Layout:
        """The layout of a mapping of dimension names to sizes (unknown names refused)."""
        unknown = sorted(set(sizes) - set(DIMS))
        if unknown:
            raise ConfigError(
                f"parallel: unknown dimension(s) {', '.join(map(repr, unknown))}; the "
                f"dimensions are {', '.join(DIMS)}"
            )
        return cls(**sizes)

    def sizes(self) -> dict[str, int]:
        """Each dimension's size, outermost first."""
        return {n: getattr(self, n) for n in DIMS}

    def resolved(self, world_size: int) -> Layout:
        """This layout over ``world_size`` ranks: ``-1`` replaced, the product checked."""
        fixed = math.prod(v for v in self.sizes().values() if v != -1)
        free = [n for n in DIMS if getattr(self, n) == -1]
        if free and world_size % fixed == 0:
            return dataclasses.replace(self, **{free[0]: world_size // fixed})
        if not free and fixed == world_size:
            return self
        raise ConfigError(
            f"parallel layout {self.described(all_dims=bool(free))} over {world_size} "
            f"rank(s): the sizes multiply to {fixed}"
            + (f", which does not divide {world_size}" if free else f", not {world_size}")
            + ": change a size (or the number of devices) so that they multiply to the ranks, "
            "or give one dimension as -1 to take what the others leave"
        )

    def described(self, all_dims: bool = False) -> str:
        """The dimensions larger than one (with ``all_dims``: also one given as -1), e.g.
        ``"pp 2 x dp_shard 2 x tp 2"``; ``"dp_shard 1"`` for one rank."""
        shown = [f"{n} {v}" for n, v in self.sizes().items() if v > 1 or (all_dims and v == -1)]
        return " x ".join(shown) or "dp_shard 1"

    @property
    def data_parallel(self) -> int:
        """Ranks that read different samples: replicas times shards."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dimension (the mesh is row-major, outermost first)."""
        out: dict[str, int] = {}
        for name in reversed(DIMS):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return {n: out[n] for n in DIMS}


__all__ = ["DIMS", "Layout"]
