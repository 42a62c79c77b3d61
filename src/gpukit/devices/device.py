"""Devices: what this machine has, how to name one, and where new tensors go.

>>> import gpukit as gk
>>> gk.device("cpu")
Device(cpu, ...)
>>> str(gk.device("/cpu:0"))
'cpu'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from gpukit import _env
from gpukit._util.text import described, format_bytes
from gpukit.devices import hw as _hw
from gpukit.devices.spec import AUTO, SPELLINGS, DeviceType, Spec, SpecError, parse
from gpukit.errors import DeviceError, warn_user

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
    found = [_lookup("cpu", 0), *(_lookup("cuda", i) for i in range(_hw.cuda_count()))]
    found.append(_lookup("mps", 0))
    return [d for d in found if d is not None]


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
    if not isinstance(soft, bool):
        raise DeviceError(
            f"device(soft={described(soft)}): give True (fall back to the best device with a "
            "warning) or False (raise when the device is missing)"
        )
    try:
        # A Device is re-checked as its spelling: Device("tpu") or Device("cpu", 3) are refused
        # like the strings would be.
        parsed = parse(f"{spec.type}:{spec.index}" if isinstance(spec, Device) else spec)
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
        raise DeviceError(f"gpu(i={described(i)}): i must be a GPU index (an int), e.g. gk.gpu(0)")
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
    match = _lookup(kind, index or 0)
    if match is not None:
        return match
    problem, fix = _why_missing(kind, index or 0)
    if soft:
        fallback = _best()
        warn_user(f"device {_show(given)} is not available ({problem}); using {fallback} instead")
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
    for kind in ("cuda", "mps"):
        found = _lookup(kind, 0)
        if found is not None:
            return found
    return _cpu()


def _lookup(kind: DeviceType, index: int) -> Device | None:
    """The device if this process can use it, else None; asks only about that one device."""
    if kind == "cpu":
        return _cpu() if index == 0 else None
    if kind == "mps":
        return (
            Device("mps", 0, "Apple GPU (Metal)", _hw.ram_total())
            if (index == 0 and _hw.mps_available())
            else None
        )
    if not 0 <= index < _hw.cuda_count():
        return None
    try:
        props = _hw.cuda_properties(index)
    except Exception:  # CUDA cannot start on it: unusable, and _why_missing says why
        return None
    return Device("cuda", index, props.name, props.total_memory, props.capability)


def _cpu() -> Device:
    return Device("cpu", 0, _hw.cpu_name(), _hw.ram_total())


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
    if index < count:
        return (
            f"CUDA cannot start on GPU {index}: {_start_error(index)}",
            f"`nvidia-smi` shows whether another process holds it or it is in a bad state; "
            f"`gpukit doctor` checks the setup, {soft}",
        )
    use = f"use gpu:0..{count - 1}" if count > 1 else "use gpu:0"
    if visible is not None:
        return (
            f"index {index} is beyond the {count} GPU{'s' if count > 1 else ''} that "
            f"CUDA_VISIBLE_DEVICES={visible!r} leaves visible, renumbered from 0",
            f"{use}, or add the GPU to CUDA_VISIBLE_DEVICES, {soft}",
        )
    return f"there is no GPU {index}", f"{use}, {soft}"


def _start_error(index: int) -> str:
    try:
        _hw.cuda_properties(index)
    except Exception as err:
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return "unknown error"


def _listing() -> str:
    try:
        return ", ".join(str(d) for d in devices())
    except Exception:  # an error message must not fail because discovery does
        return "devices that could not be listed"


def _show(spec: object) -> str:
    if isinstance(spec, Device):
        return repr(str(spec))
    return described(spec)


__all__ = ["SPELLINGS", "Device", "DeviceSpec", "cpu", "device", "devices", "gpu", "on"]
