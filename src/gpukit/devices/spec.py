"""Parse every common spelling of a device into (kind, index).

Pure syntax: whether the device exists is decided in ``devices.py``. Spellings accepted,
case-insensitively and ignoring surrounding spaces:

- PyTorch: ``cpu``, ``cuda``, ``cuda:1``, ``mps``, a ``torch.device``;
- TensorFlow: ``GPU:1``, ``/gpu:1``, ``/cpu:0``, ``/device:GPU:1``,
  ``/job:localhost/replica:0/task:0/device:GPU:1``;
- MXNet and plain numbers: ``gpu``, ``gpu:1``, ``1`` (an int means a GPU index);
- ``auto`` (or None): the best device available.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

DeviceType = Literal["cpu", "cuda", "mps"]

_KINDS: dict[str, DeviceType] = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda", "mps": "mps"}

# Kinds people try that gpukit cannot place on, with the reason to give them.
_UNSUPPORTED = {
    "tpu": "TPUs are not supported (gpukit places on cpu, cuda and mps)",
    "xla": "XLA devices are not supported (gpukit places on cpu, cuda and mps)",
    "hip": "ROCm builds of torch name AMD GPUs 'cuda'",
    "rocm": "ROCm builds of torch name AMD GPUs 'cuda'",
    "meta": "'meta' tensors have no data and no device to run on",
}

_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII only: str.isdigit() admits '²', which int() rejects
_PLAIN = re.compile(r"(?P<kind>[a-z_]+)(?::(?P<index>[^:]*))?")
# /job:J/replica:R/task:T/device:KIND:N, every part before the device optional,
# "device:" optional too (TensorFlow 1 wrote /gpu:0).
_TENSORFLOW = re.compile(
    r"(?:/job:(?P<job>[^/]*))?(?:/replica:(?P<replica>[^/]*))?(?:/task:(?P<task>[^/]*))?"
    r"/(?:device:)?(?P<kind>[a-z_]+)(?::(?P<index>[^/:]*))?"
)

SPELLINGS = "'cuda:0', 'gpu:0', '/gpu:0', '/device:GPU:0', 0, 'cpu' or 'mps'"


class SpecError(Exception):
    """A spec that is not a device spelling; ``devices.py`` turns it into a DeviceError."""

    def __init__(self, problem: str, fix: str = f"write it as {SPELLINGS}") -> None:
        super().__init__(problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class Spec:
    """A parsed spec. ``index`` None means "the current one" (cuda) or "the only one"."""

    kind: DeviceType | Literal["auto"]
    index: int | None = None


AUTO = Spec("auto")


def parse(spec: object) -> Spec:
    """Turn a user's device spec into a :class:`Spec`, or raise :class:`SpecError`.

    >>> parse("/job:localhost/replica:0/task:0/device:GPU:1")
    Spec(kind='cuda', index=1)
    >>> parse(2)
    Spec(kind='cuda', index=2)
    """
    if spec is None:
        return AUTO
    if isinstance(spec, bool):  # bool is an int; True is not "GPU 1"
        raise SpecError(f"a bool ({spec}) is not a device")
    if isinstance(spec, int):
        return _checked("cuda", spec)
    if isinstance(spec, torch.device):
        return _from_kind(spec.type, spec.index)
    if isinstance(spec, str):
        return _parse_text(spec)
    raise SpecError(
        f"a {type(spec).__name__} is not a device spec",
        f"pass a string, an int, a torch.device or a gpukit Device, e.g. {SPELLINGS}",
    )


def _parse_text(text: str) -> Spec:
    s = text.strip().lower()
    if not s:
        raise SpecError(
            "the device spec is empty", f"use 'auto' for the best device, or {SPELLINGS}"
        )
    if s == "auto":
        return AUTO
    if _INTEGER.fullmatch(s):
        return _checked("cuda", _whole(s))
    if s.startswith("/"):
        return _parse_tensorflow(s)
    match = _PLAIN.fullmatch(s)
    if not match:
        raise SpecError("not a device spelling")
    return _from_kind(match["kind"], _index(match["index"]))


def _parse_tensorflow(s: str) -> Spec:
    match = _TENSORFLOW.fullmatch(s)
    if not match:
        raise SpecError("not a TensorFlow device name", "write it as '/gpu:0' or '/device:GPU:0'")
    job, replica, task = match["job"], match["replica"], match["task"]
    if job not in (None, "localhost") or replica not in (None, "0") or task not in (None, "0"):
        raise SpecError(
            "it names a device of another TensorFlow job, replica or task",
            "gpukit places on this machine: drop the /job:.../replica:.../task:... prefix",
        )
    return _from_kind(match["kind"], _index(match["index"]))


def _index(text: str | None) -> int | None:
    if text is None:
        return None
    if not text:
        raise SpecError("the index after ':' is missing")
    if not _INTEGER.fullmatch(text):
        raise SpecError(f"the index {text!r} is not a whole number")
    return _whole(text)


def _whole(digits: str) -> int:
    # int() refuses strings over 4300 digits with a plain ValueError; no machine has 10**9 GPUs.
    if len(digits.lstrip("+-")) > 9:
        raise SpecError(f"the index {digits[:12]}... is too large", "device indices count from 0")
    return int(digits)


def _from_kind(kind: str, index: int | None) -> Spec:
    if kind in _UNSUPPORTED:
        raise SpecError(_UNSUPPORTED[kind], f"use {SPELLINGS}")
    if kind not in _KINDS:
        raise SpecError(f"unknown device kind {kind!r}", f"use {SPELLINGS}")
    return _checked(_KINDS[kind], index)


def _checked(kind: DeviceType, index: int | None) -> Spec:
    if index is not None and index < 0:
        raise SpecError(f"the index {index} is negative", "device indices count from 0")
    if kind in ("cpu", "mps") and index not in (None, 0):
        raise SpecError(f"there is only one {kind} device, {kind}:0", f"use '{kind}'")
    return Spec(kind, index)
