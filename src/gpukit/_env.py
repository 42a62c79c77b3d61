"""The one place that reads gpukit's environment variables (all prefixed ``GPUKIT_``).

Other modules ask here, so the full list of variables lives in one file:

- ``GPUKIT_DEVICE``: the device ``gk.device()`` returns when asked for the best one
  (any spelling ``gk.device`` accepts, e.g. ``cpu`` or ``/gpu:1``).
- ``GPUKIT_FAULT_OOM_ABOVE``: fault injection for testing out-of-memory recovery:
  ``rt.train_step`` raises a real ``torch.OutOfMemoryError`` for every micro-batch of more
  than this many samples.
- ``GPUKIT_COLLECTIVE_CHECK_TIMEOUT``: seconds ``rt.save`` waits for every rank to arrive
  before it fails naming the missing ones (default 30).
- ``GPUKIT_CACHE_DIR``: the folder where gpukit keeps what it measured on this machine (the
  copy speeds and latencies of ``gpukit bench transfer``, which ``gk.trace`` ranks its
  findings with); default ``$XDG_CACHE_HOME/gpukit``, else ``~/.cache/gpukit``.

``CUDA_LAUNCH_BLOCKING`` is set here for ``gpukit trace --blocking``. The CUDA variables that
gpukit reads only to explain things (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``) and the
variables a launcher such as torchrun sets for each process (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are read here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_device_spec() -> str | None:
    """``GPUKIT_DEVICE``, or None when unset or blank."""
    value = os.environ.get("GPUKIT_DEVICE", "").strip()
    return value or None


def fault_oom_above() -> int | None:
    """``GPUKIT_FAULT_OOM_ABOVE`` as a sample count, or None when unset or blank."""
    value = os.environ.get("GPUKIT_FAULT_OOM_ABOVE", "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        from gpukit.errors import ConfigError

        raise ConfigError(
            f"GPUKIT_FAULT_OOM_ABOVE={value!r}: give a whole number of samples of at least 1 "
            "(micro-batches larger than it fail as if out of memory), or unset it"
        )
    return int(value)


def collective_check_timeout() -> float:
    """``GPUKIT_COLLECTIVE_CHECK_TIMEOUT`` in seconds (default 30)."""
    value = os.environ.get("GPUKIT_COLLECTIVE_CHECK_TIMEOUT", "").strip()
    if not value:
        return 30.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        from gpukit.errors import ConfigError

        raise ConfigError(
            f"GPUKIT_COLLECTIVE_CHECK_TIMEOUT={value!r}: give a positive number of seconds "
            "(how long a collective call waits for every rank), or unset it"
        )
    return seconds


def cache_dir() -> Path:
    """``GPUKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpukit``, else ``~/.cache/gpukit`` (the
    folder may not exist yet). A relative ``XDG_CACHE_HOME`` is ignored, as the XDG base
    directory specification asks."""
    value = os.environ.get("GPUKIT_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "gpukit"
    return Path.home() / ".cache" / "gpukit"


def set_cuda_launch_blocking() -> None:
    """``CUDA_LAUNCH_BLOCKING=1``: every kernel launch waits for the kernel, so a CUDA error is
    raised at the line that caused it (CUDA reads this when it starts, so set it before)."""
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (possibly empty), or None when unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def cuda_device_order() -> str | None:
    """``CUDA_DEVICE_ORDER`` as set, or None when unset (CUDA then orders fastest first)."""
    return os.environ.get("CUDA_DEVICE_ORDER")


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a job started by a launcher (torchrun, gpukit launch)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def launched() -> LaunchEnv | None:
    """The launcher's placement of this process, or None when no launcher started it."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return LaunchEnv(
        rank=int(os.environ["RANK"]),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )
