"""Devices: what this machine has, how to name one, and where new tensors go.

>>> import gpukit as gk
>>> gk.device("cpu")
Device(cpu, ...)
>>> str(gk.device("/cpu:0"))
'cpu'
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gpukit import _env, _hw
from gpukit._devspec import AUTO, SPELLINGS, DeviceType, Spec, SpecError, parse
from gpukit._format import format_bytes
from gpukit.errors import DeviceError

DeviceSpec = Any  # str | int | torch.device | Device | None; Any keeps call sites simple to type


@dataclass(frozen=True)
class Device:
    """One device of this machine. Two Devices are equal when their type and index are.

    >>> d = Device("cuda", 1, "NVIDIA H100 80GB HBM3", 80 * 1024**3, (9, 0))
    >>> str(d), d.torch
    ('cuda:1', device(type='cuda', index=1))
    """

    type: DeviceType
    index: int = 0
    name: str = field(default="", compare=False)
    total_memory: int | None = field(default=None, compare=False)  # bytes
    compute_capability: tuple[int, int] | None = field(default=None, compare=False)

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.type == "cuda" else self.type

    def __repr__(self) -> str:
        parts = [str(self)]
        if self.name:
            parts.append(repr(self.name))
        if self.total_memory:
            parts.append(format_bytes(self.total_memory))
        return f"Device({', '.join(parts)})"

    @property
    def torch(self) -> torch.device:
        """The same device as a ``torch.device``."""
        return torch.device(str(self))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (the schema ``gpukit devices --json`` prints)."""
        cc = self.compute_capability
        return {
            "device": str(self),
            "type": self.type,
            "index": self.index,
            "name": self.name,
            "total_memory": self.total_memory,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        }


def devices() -> list[Device]:
    """Every device this process can use: the CPU first, then CUDA GPUs, then MPS.

    >>> import gpukit as gk
    >>> gk.devices()[0]
    Device(cpu, ...)
    """
    found = [Device("cpu", 0, _hw.cpu_name(), _hw.ram_total())]
    for i in range(_hw.cuda_count()):
        props = _hw.cuda_properties(i)
        found.append(Device("cuda", i, props.name, props.total_memory, props.capability))
    if _hw.mps_available():
        found.append(Device("mps", 0, "Apple GPU (Metal)", _hw.ram_total()))
    return found


def device(spec: DeviceSpec = None, *, soft: bool = False) -> Device:
    """Resolve any common spelling of a device to a :class:`Device` of this machine.

    ``None`` or ``"auto"`` give the best device: ``GPUKIT_DEVICE`` if set, else ``cuda:0``,
    else ``mps``, else ``cpu``. A bare ``"cuda"``/``"gpu"`` is the current CUDA device.
    A device this machine lacks raises :class:`DeviceError`, or with ``soft=True`` falls back
    to the best available one with a warning (TensorFlow's soft placement). Malformed specs
    always raise.

    >>> import gpukit as gk
    >>> gk.device("/job:localhost/replica:0/task:0/device:CPU:0")
    Device(cpu, ...)
    >>> gk.device("gpu:7", soft=True)  # doctest: +SKIP
    Device(cpu, ...)
    """
    if isinstance(spec, Device):
        parsed = Spec(spec.type, spec.index)
    else:
        try:
            parsed = parse(spec)
        except SpecError as err:
            raise DeviceError(
                f"invalid device {_show(spec)}: {err.problem}; this machine has {_listing()} "
                f"({err.fix})"
            ) from None
    if parsed == AUTO:
        return _auto(soft)
    return _resolve(parsed, spec, soft)


def cpu() -> Device:
    """The CPU, like MXNet's ``mx.cpu()``."""
    return device("cpu")


def gpu(i: int = 0) -> Device:
    """GPU number ``i``, like MXNet's ``mx.gpu(i)``; raises DeviceError if there is none."""
    if isinstance(i, bool) or not isinstance(i, int):
        raise DeviceError(f"gpu(i={i!r}): i must be a GPU index (an int), e.g. gk.gpu(0)")
    return device(i)


@contextmanager
def on(spec: DeviceSpec) -> Iterator[Device]:
    """Make ``spec`` the default device for new tensors (and the current CUDA device) inside.

    Scopes nest; leaving one restores the device of the enclosing scope. Like torch's own
    default-device scope, it applies to the current thread.

    >>> import torch, gpukit as gk
    >>> with gk.on("cpu") as dev:
    ...     torch.ones(2).device.type
    'cpu'
    """
    dev = device(spec)
    with ExitStack() as scope:
        scope.enter_context(dev.torch)
        if dev.type == "cuda":
            scope.enter_context(_hw.cuda_device_scope(dev.index))
        yield dev


def _resolve(parsed: Spec, given: DeviceSpec, soft: bool) -> Device:
    kind = parsed.kind
    assert kind != "auto", "callers resolve auto through _auto()"
    index = parsed.index
    if kind == "cuda" and index is None:
        index = _hw.cuda_current()
    found = {(d.type, d.index): d for d in devices()}
    match = found.get((kind, index or 0))
    if match is not None:
        return match
    problem, fix = _why_missing(kind, index or 0)
    if soft:
        fallback = _best()
        warnings.warn(
            f"device {_show(given)} is not available ({problem}); using {fallback} instead",
            stacklevel=3,
        )
        return fallback
    raise DeviceError(
        f"unknown device {_show(given)}: {problem}; this machine has {_listing()} ({fix})"
    )


def _auto(soft: bool) -> Device:
    env = _env.default_device_spec()
    if env is None or env.lower() == "auto":
        return _best()
    try:
        parsed = parse(env)
    except SpecError as err:
        raise DeviceError(
            f"GPUKIT_DEVICE={env!r} is not a device: {err.problem} ({err.fix}, or unset it)"
        ) from None
    try:
        return _resolve(parsed, env, soft)
    except DeviceError as err:
        raise DeviceError(f"GPUKIT_DEVICE: {err}") from None


def _best() -> Device:
    """cuda:0, else mps, else cpu: the fastest device that is surely there."""
    found = devices()
    for kind in ("cuda", "mps"):
        for d in found:
            if d.type == kind:
                return d
    return found[0]


def _why_missing(kind: DeviceType, index: int) -> tuple[str, str]:
    """(what is wrong, how to fix it) for a device that is not among ``devices()``."""
    soft = "or soft=True to fall back"
    if kind == "mps":
        if not _hw.mps_built():
            return "this torch build has no MPS backend (Apple GPUs only)", f"use 'cpu', {soft}"
        return "MPS is built but unavailable (it needs macOS 12.3+)", f"use 'cpu', {soft}"
    if not _hw.cuda_built():
        return (
            f"this torch build ({torch.__version__}) is CPU-only",
            f"install a CUDA build of torch, {soft}; `gpukit doctor` checks the setup",
        )
    visible = _env.cuda_visible_devices()
    count = _hw.cuda_count()
    if count == 0:
        if visible is not None:
            return (
                f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
                f"unset CUDA_VISIBLE_DEVICES or list the GPUs to use, {soft}",
            )
        return "torch finds no GPU", f"run `gpukit doctor` to see why, {soft}"
    use = f"use gpu:0..{count - 1}" if count > 1 else "use gpu:0"
    if visible is not None:
        return (
            f"index {index} is hidden by CUDA_VISIBLE_DEVICES={visible!r}, which leaves "
            f"{count} GPU{'s' if count > 1 else ''} visible, renumbered from 0",
            f"{use}, or add the GPU to CUDA_VISIBLE_DEVICES, {soft}",
        )
    return f"there is no GPU {index}", f"{use}, {soft}"


def _listing() -> str:
    try:
        return ", ".join(str(d) for d in devices())
    except Exception:  # an error message must not fail because discovery does
        return "devices that could not be listed"


def _show(spec: object) -> str:
    if isinstance(spec, Device):
        return repr(str(spec))
    return repr(spec) if isinstance(spec, str) else f"{spec!r} ({type(spec).__name__})"


__all__ = ["SPELLINGS", "Device", "DeviceSpec", "cpu", "device", "devices", "gpu", "on"]
