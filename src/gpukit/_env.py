"""The one place that reads gpukit's environment variables (all prefixed ``GPUKIT_``).

Other modules ask here, so the full list of variables lives in one file:

- ``GPUKIT_DEVICE``: the device ``gk.device()`` returns when asked for the best one
  (any spelling ``gk.device`` accepts, e.g. ``cpu`` or ``/gpu:1``).

The CUDA variables that gpukit reads only to explain things (``CUDA_VISIBLE_DEVICES``,
``CUDA_DEVICE_ORDER``) are read here too.
"""

from __future__ import annotations

import os


def default_device_spec() -> str | None:
    """``GPUKIT_DEVICE``, or None when unset or blank."""
    value = os.environ.get("GPUKIT_DEVICE", "").strip()
    return value or None


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (possibly empty), or None when unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def cuda_device_order() -> str | None:
    """``CUDA_DEVICE_ORDER`` as set, or None when unset (CUDA then orders fastest first)."""
    return os.environ.get("CUDA_DEVICE_ORDER")
