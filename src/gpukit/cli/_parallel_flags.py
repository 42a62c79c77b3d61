"""``gpukit train``'s flags that name one mesh of every parallelism dimension (``--tp 2 --pp
2``), made into the Runtime's ``parallel=`` setting.

>>> from gpukit.cli.__main__ import build_parser
>>> parallel_setting(build_parser().parse_args(["train", "--tp", "2"]))
{'tp': 2}
"""

from __future__ import annotations

import argparse
from typing import Any

from gpukit.errors import ConfigError
from gpukit.strategies import Parallel

# gpukit train's flags that name a mesh (gk.Runtime(parallel=...)), by Parallel's keywords.
_MESH_FLAGS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "pp_schedule", "float8")


def parallel_setting(args: argparse.Namespace) -> dict[str, Any] | None:
    """``parallel=`` from ``--tp 2 --pp 2`` and the like (with fsdp's own flags, which the
    mesh shards with); None when none of them is given."""
    given = {k: getattr(args, k) for k in _MESH_FLAGS if getattr(args, k) is not None}
    if not given and args.strategy != Parallel.name:
        return None
    if args.strategy not in ("auto", Parallel.name):
        shown = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise ConfigError(
            f"{shown} trains on one mesh of every parallelism dimension, which is its own "
            f"strategy (parallel), and --strategy {args.strategy} was given too: drop "
            f"--strategy (or drop {shown})"
        )
    if args.activation_checkpointing is not None:
        given["activation_checkpointing"] = args.activation_checkpointing
    if args.fsdp_mixed is not None:
        given["mixed"] = args.fsdp_mixed
    return given
