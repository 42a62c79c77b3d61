"""An op as the placement log sees it: the device, shape and dtype of each tensor it read and
wrote (:class:`TensorSpec`), the op with its module (:class:`OpRecord`), and what the log's
summary counts it by (:func:`fact`: its device, whether it copied across devices, whether
its inputs mixed them).

Apart from the log's bookkeeping (:mod:`gpukit.diagnostics.oplog`), since these run for every
op a model runs and are kept lean for it, and are plain data that tests can build by hand.

>>> import torch
>>> print(joined(specs((torch.ones(3, 4), 2, [torch.zeros(2, dtype=torch.int64)]))))
cpu[3,4]f32, cpu[2]i64
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from gpukit._util import tree

# In-place copies write into a tensor that is also an input, so "an output on a device no input
# is on" misses them; these ops are copies whenever their inputs span devices.
_COPY_OPS = frozenset({"aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"})
_new = tuple.__new__  # NamedTuple without its Python-level __new__: the per-op path stays lean
_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
}


class TensorSpec(NamedTuple):
    """Device, shape and dtype of one tensor an op read or wrote; ``str()`` is ``cpu[8,32]f32``."""

    device: torch.device
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __str__(self) -> str:
        dtype = _DTYPES.get(self.dtype) or str(self.dtype).removeprefix("torch.")
        return f"{self.device}[{','.join(map(str, self.shape))}]{dtype}"


class OpRecord(NamedTuple):
    """One op as it ran: its name, tensor inputs and outputs, and the innermost module."""

    op: str  # e.g. "aten::addmm"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]  # empty when the op returned no tensor, or raised
    module: str  # qualified name with model=, else class name; or BACKWARD / NO_MODULE

    @property
    def device(self) -> str:
        """Where the op ran: its first output's device, else its first input's, else ``-``."""
        specs = self.outputs or self.inputs
        return str(specs[0].device) if specs else "-"

    def line(self) -> str:
        """``aten::addmm  cpu <- cpu[2]f32, cpu[3,4]f32, ... -> cpu[3,2]f32  (0)``."""
        return f"{self.op}  {self.device} <- {joined(self.inputs)} -> {joined(self.outputs)}  " + (
            self.module if self.module.startswith("(") else f"({self.module})"
        )


# What summary() counts an op by: (op, module, device, copy (src, dst), mixed devices).
FactKey = tuple[str, str, str, tuple[str, str] | None, tuple[str, ...] | None]


def _spec(t: torch.Tensor) -> TensorSpec:
    try:
        shape = t.shape
    except (RuntimeError, ValueError):  # e.g. ragged nested tensors: a log must never break a run
        shape = torch.Size()
    return _new(TensorSpec, (t.device, shape, t.dtype))


# Values of op arguments that never hold a tensor: no walk for them.
_PLAIN = (
    int,
    float,
    complex,
    str,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)


def specs(obj: Any) -> tuple[TensorSpec, ...]:
    """The specs of the tensors in ``obj`` (an op's arguments or outputs, a module's inputs or
    output), in order.

    It runs for every op, whose arguments are tensors, plain values and lists of either (by the
    op schemas): those are read here without the generators of a walk, which would cost
    several times more; anything else (a module's dicts, dataclasses) goes through the walker.
    """
    if isinstance(obj, torch.Tensor):
        return (_spec(obj),)
    if type(obj) is not tuple and type(obj) is not list:
        return () if isinstance(obj, _PLAIN) else walked(obj)
    found: list[TensorSpec] = []
    for item in obj:
        if isinstance(item, torch.Tensor):
            found.append(_spec(item))
        elif type(item) is list or type(item) is tuple:  # Tensor[], int[]: cat, view, foreach
            for value in item:
                if isinstance(value, torch.Tensor):
                    found.append(_spec(value))
                elif not isinstance(value, _PLAIN):
                    found.extend(walked(value))
        elif not isinstance(item, _PLAIN):
            found.extend(walked(item))
    return tuple(found)


Placement = tuple[Any, ...]  # what signature() gives: a device, or (device,) for a 0-dim tensor


def signature(obj: Any) -> Placement | None:
    """Where the tensors of an op's arguments or outputs are, in order: each tensor's device,
    as a 1-tuple for a 0-dim one; None when ``obj`` holds more than tensors, plain values and
    lists of them (then only :func:`specs` reads it).

    Everything :func:`fact` tells of an op but the bytes it copied follows from its name,
    module and the signatures of its inputs and outputs, so the placement log counts by them,
    at a fraction of the cost of :func:`specs` and :func:`fact`.

    >>> signature((torch.ones(2), 3, [torch.tensor(1.0)]))
    (device(type='cpu'), (device(type='cpu'),))
    """
    if isinstance(obj, torch.Tensor):
        return (obj.device,) if obj.dim() else ((obj.device,),)
    if type(obj) is not tuple and type(obj) is not list:
        return () if isinstance(obj, _PLAIN) else None
    found: list[Any] = []
    for item in obj:
        if isinstance(item, torch.Tensor):
            found.append(item.device if item.dim() else (item.device,))
        elif type(item) is list or type(item) is tuple:
            for value in item:
                if isinstance(value, torch.Tensor):
                    found.append(value.device if value.dim() else (value.device,))
                elif not isinstance(value, _PLAIN):
                    return None
        elif not isinstance(item, _PLAIN):
            return None
    return tuple(found)


def walked(obj: Any) -> tuple[TensorSpec, ...]:
    """The specs of every tensor in ``obj``, found by the one walker of nested data."""
    return tuple(map(_spec, tree.tensors(obj)))


def fact(
    op: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...], module: str
) -> tuple[FactKey, int]:
    """What summary() needs of one op: its kind (op, module, device, copy, mixed), bytes copied."""
    specs = outputs or inputs
    dev = str(specs[0].device) if specs else "-"
    src, dst = {str(s.device) for s in inputs}, {str(s.device) for s in outputs}
    copy, nbytes = None, 0
    if src and dst and src != dst and (dst - src or (op in _COPY_OPS and src - dst)):
        copy = (",".join(sorted(src - dst or src)), ",".join(sorted(dst - src or dst)))
        nbytes = sum(s.nbytes for s in outputs)
    elif op == "aten::_local_scalar_dense" and src and src != {"cpu"}:  # .item(): device->host
        copy, nbytes = (dev, "cpu"), inputs[0].dtype.itemsize
    mixed = None
    if copy is None:
        # CPU scalars are legal operands on any device (their value goes in as an argument).
        devs = {str(s.device) for s in inputs if s.shape or s.device.type != "cpu"}
        mixed = tuple(sorted(devs)) if len(devs) > 1 else None
    return (op, module, dev, copy, mixed), nbytes


def joined(specs: tuple[TensorSpec, ...]) -> str:
    """Specs as a log line shows them: ``cpu[2]f32, cpu[3,4]f32``, or ``-`` for none."""
    return ", ".join(map(str, specs)) or "-"
