"""This process's place in a job a launcher started (torchrun, ``gpukit launch``, Slurm through
either): the ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` variables that
every launcher sets, read and checked in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a job started by a launcher (torchrun, gpukit launch)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launched() -> LaunchEnv | None:
    """The launcher's placement of this process, or None when no launcher started it (``RANK``
    or ``WORLD_SIZE`` unset or blank). Values that cannot be a placement (not a whole number,
    a rank outside the job, a local group larger than the job) raise ConfigError naming the
    variable: training on a made-up rank would wait forever for processes that do not exist.
    ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE``, ``LOCAL_RANK`` to this process's place
    within it."""
    rank_text, world_text = _launch_value("RANK"), _launch_value("WORLD_SIZE")
    if rank_text is None or world_text is None:
        return None
    world = _launch_number("WORLD_SIZE", world_text, 1, None, "a number of processes")
    rank = _launch_number("RANK", rank_text, 0, world, f"a rank of the WORLD_SIZE={world} job")
    local_text = _launch_value("LOCAL_WORLD_SIZE")
    local_world = (
        world
        if local_text is None
        else _launch_number("LOCAL_WORLD_SIZE", local_text, 1, world + 1, "a process count")
    )
    local_rank_text = _launch_value("LOCAL_RANK")
    local_rank = (
        rank % local_world
        if local_rank_text is None
        else _launch_number("LOCAL_RANK", local_rank_text, 0, local_world, "a rank on this machine")
    )
    return LaunchEnv(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world
    )


def _launch_value(name: str) -> str | None:
    """A launcher variable as set, or None when unset or blank."""
    return os.environ.get(name, "").strip() or None


def _launch_number(name: str, text: str, low: int, below: int | None, what: str) -> int:
    """``text`` as a whole number from ``low`` to ``below - 1`` (no upper bound when None)."""
    # ASCII digits only: str.isdigit() admits '²' and int() admits '٢', neither a launcher's.
    value = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None
    if value is not None and value >= low and (below is None or value < below):
        return value
    allowed = f"{low}..{(below or 10**9) - 1}"
    from gpukit.errors import ConfigError

    raise ConfigError(
        f"{name}={text!r} is not {what} ({allowed}), yet RANK and WORLD_SIZE say a launcher "
        "started this process. Unset RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE to run "
        "as one process, or start it with `gpukit launch --nproc N script.py` (or torchrun), "
        "which sets them"
    )
