"""Figures measured on this machine, per GPU model, kept between runs.

``gpukit bench transfer`` measures how fast this machine copies between host and GPU and how
long the host waits for a tiny copy; it keeps those figures here, and ``gk.trace`` ranks its
findings with them instead of rough constants. The store is one JSON file,
``measured.json`` in the cache folder (``GPUKIT_CACHE_DIR``, see :mod:`gpukit._env`),
keyed by the GPU's name, each entry with the date it was measured and the torch version:

``{"schema": 1, "gpus": {"NVIDIA H100 80GB HBM3": {"date": ..., "torch": ..., "quick": false,
"figures": {"h2d_pinned_bps": 5.3e10, ...}}}}``

The figures (:data:`FIGURES`) are bytes per second (``*_bps``: the best over the sizes
measured) and seconds (``*_latency_s``: one blocking copy of 4 bytes, as the host sees it).

>>> import os, tempfile
>>> os.environ["GPUKIT_CACHE_DIR"] = tempfile.mkdtemp()
>>> _ = save("NVIDIA H100 80GB HBM3", {"h2d_pinned_bps": 5.3e10})
>>> load("NVIDIA H100 80GB HBM3")["figures"]
{'h2d_pinned_bps': 53000000000.0}
>>> load("NVIDIA A100-SXM4-80GB") is None
True
>>> del os.environ["GPUKIT_CACHE_DIR"]
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from gpukit import _env
from gpukit._util.files import make_folder, write_atomic

SCHEMA = 1
FILE_NAME = "measured.json"

# What each figure means; a store may hold fewer (d2d_peer_bps needs two GPUs).
FIGURES = {
    "h2d_pageable_bps": "host to device from pageable memory, bytes/s",
    "h2d_pinned_bps": "host to device from pinned memory, bytes/s",
    "d2h_pageable_bps": "device to host into pageable memory, bytes/s",
    "d2h_pinned_bps": "device to host into pinned memory, bytes/s",
    "d2d_peer_bps": "from this GPU to another one, bytes/s",
    "d2d_local_bps": "from one buffer of this GPU to another, bytes/s",
    "h2d_latency_s": "one blocking 4-byte host-to-device copy, seconds",
    "d2h_latency_s": "one blocking 4-byte device-to-host copy (a round trip), seconds",
}


def path() -> Path:
    """The store's file (it may not exist yet)."""
    return _env.cache_dir() / FILE_NAME


def save(device_name: str, figures: dict[str, float], *, quick: bool = False) -> Path:
    """Keep ``figures`` for the GPU called ``device_name``, with today's date and the torch
    version, replacing what was kept for it before; returns the file written.

    Written to a temporary file first and renamed over the old one, so a reader never sees
    half a file. Raises :class:`~gpukit.errors.OutputWriteError` (an ``OSError``) naming the
    file, the errno and the fix when the folder cannot be created or written: a caller that
    measured something worth more than its record catches it.
    """
    store = _read(path())
    store.setdefault("gpus", {})[device_name] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "quick": quick,
        "figures": {k: float(v) for k, v in figures.items()},
    }
    target = path()
    make_folder(target.parent, option="GPUKIT_CACHE_DIR")
    text = json.dumps({**store, "schema": SCHEMA}, indent=2, sort_keys=True) + "\n"
    write_atomic(target, text, option="GPUKIT_CACHE_DIR")
    return target


def load(device_name: str) -> dict[str, Any] | None:
    """What was kept for the GPU called ``device_name``: ``{"date", "torch", "quick",
    "figures"}``, the figures reduced to positive finite numbers; None when nothing usable
    was kept. Never raises: a missing, unreadable or foreign file is as good as none."""
    entry = _read(path()).get("gpus", {}).get(device_name)
    if not isinstance(entry, dict) or not isinstance(entry.get("figures"), dict):
        return None
    figures = {
        str(k): float(v)
        for k, v in entry["figures"].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf
    }
    if not figures:
        return None
    return {
        "date": str(entry.get("date", "")),
        "torch": str(entry.get("torch", "")),
        "quick": bool(entry.get("quick", False)),
        "figures": figures,
    }


def _read(file: Path) -> dict[str, Any]:
    """The store in ``file``, or an empty one when it is missing, unreadable, of another
    schema or not a store at all (it is rewritten whole by the next save)."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        return {}
    if not isinstance(data.get("gpus"), dict):
        return {}
    return data
