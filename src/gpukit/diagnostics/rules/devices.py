"""Tensors on different devices, in words: every message torch has for an op whose tensors are
not on one device (the dispatcher's, old CUDA kernels', cuDNN's, indexing's), with the devices,
the op and the argument read from it (see ``gpukit.diagnostics.readable``)."""

from __future__ import annotations

import re

from gpukit._util.text import explained as _say
from gpukit.errors import CrossDeviceError, GpukitError

_DEV = r"([a-z_]+(?::[0-9]+)?)"  # cpu, cuda:0, meta, mps; stops before "!", ",", ")"

_TWO = re.compile(rf"found at least two devices, {_DEV} and {_DEV}!")
_ARG_OLD = re.compile(r"when checking argument for argument (\w+) in method (\w+)")
_GOT = re.compile(
    rf"but got (\w+) is on {_DEV}, different from other tensors on {_DEV}"
    r"(?: \(when checking argument in method (\w+)\))?"
)
_CPU_KERNEL = re.compile(
    rf"(\w+):? expected '(\w+)' to be (?:a )?CPU tensor, but got tensor on {_DEV}"
)
_OLD_GPU = re.compile(
    r"Tensor for argument #[0-9]+ '(\w+)' is on (CPU|GPU(?: [0-9]+)?), but expected it to be "
    r"on (CPU|GPU(?: [0-9]+)?)(?: \(while checking arguments for (\w+)\))?"
)
_SAME_GPU = re.compile(
    r"tensor for argument #[0-9]+ '(\w+)' to have the same device as tensor for argument "
    r"#[0-9]+ '(\w+)'; but device ([0-9]+) does not equal ([0-9]+)"
    r"(?: \(while checking arguments for (\w+)\))?"
)
_TYPES = re.compile(
    r"Input type \(([\w.]+)\) and (weight|bias) type \(([\w.]+)\) should be the same"
)
_INDICES = re.compile(
    rf"indices should be either on {_DEV} or on the same device as the indexed tensor \({_DEV}\)"
)
_EXPECTED = re.compile(rf"Tensor on device {_DEV} is not on the expected device {_DEV}!")
_ANY = re.compile(
    r"Expected all tensors to be on the same device|[Ee]xpected [^\n]{0,80}to be on (?:the )?same "
    r"device"
)


def _op(method: str | None) -> str | None:
    # torch names the dispatcher's wrapper: wrapper_CUDA_addmm, wrapper_CUDA__cat, wrapper__cat.
    return None if method is None else re.sub(r"^wrapper_(?:[A-Z][A-Za-z]*_)?_?", "", method)


def _type_device(name: str) -> str:
    # Legacy type names (torch.cuda.FloatTensor) and newer ones (CUDABFloat16Type) both occur.
    low = name.lower()
    return next((d for d in ("cuda", "mps", "xpu") if d in low), "cpu")


def cross_device(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.CrossDeviceError` for a message about tensors on different
    devices, or None for any other.

    >>> print(str(cross_device("Expected all tensors to be on the same device, but found at "
    ...     "least two devices, cuda:0 and cpu!")).splitlines()[0])
    tensors on different devices: an op got tensors on cuda:0 and cpu
    """
    if not any(p.search(text) for p in (_ANY, _EXPECTED, _TYPES, _INDICES, _OLD_GPU, _SAME_GPU)):
        return None
    devices: tuple[str, ...] = ()
    what = None
    index_fix = False
    if m := _GOT.search(text):
        devices = (m[2], m[3])
        what = f"{_op(m[4]) or 'an op'} got {m[1]!r} on {m[2]} but its other tensors on {m[3]}"
    elif m := _TWO.search(text):
        devices = (m[1], m[2])
        arg = _ARG_OLD.search(text)
        what = f"{(_op(arg[2]) if arg else None) or 'an op'} got tensors on {m[1]} and {m[2]}"
        what += f" (argument {arg[1]!r})" if arg else ""
    elif m := _CPU_KERNEL.search(text):
        devices = (m[3], "cpu")
        what = f"{m[1]} runs on cpu (its other tensors are there) but got {m[2]!r} on {m[3]}"
    elif m := _OLD_GPU.search(text):
        devices = (m[2], m[3])
        what = f"{m[4] or 'an op'} got {m[1]!r} on {m[2]} but expected it on {m[3]}"
    elif m := _SAME_GPU.search(text):
        devices = (f"cuda:{m[3]}", f"cuda:{m[4]}")
        op = m[5] or "an op"
        what = f"{op} got {m[1]!r} on cuda:{m[3]} but {m[2]!r} on cuda:{m[4]}"
    elif m := _TYPES.search(text):
        devices = (_type_device(m[1]), _type_device(m[3]))
        if devices[0] == devices[1]:
            return None  # the same message reports a dtype mismatch; not a device problem
        what = (
            f"the input is on {devices[0]} ({m[1]}) but the layer's {m[2]} is on "
            f"{devices[1]} ({m[3]})"
        )
    elif m := _INDICES.search(text):
        devices, index_fix = (m[2],), True
        what = f"the indices are on another device than the tensor they index ({m[2]})"
    elif m := _EXPECTED.search(text):
        devices = (m[1], m[2])
        what = f"a tensor on {m[1]} met tensors on {m[2]} in one op"
    else:
        first = text.strip().splitlines()[0][:200]
        what = f"{first!r}"
    why = (
        "an op runs where its tensors are, so all of them must be on one device (only 0-dim "
        "CPU tensors may mix in); torch never moves a tensor by itself"
    )
    if "meta" in devices:
        why += (
            ". Tensors on the meta device have a shape but no data: a model built under "
            "torch.device('meta') needs model.to_empty(device=...) and its weights loaded"
        )
    fixes = [
        "put the inputs where the model is: x = gk.to(x, model_device), with model_device = "
        "next(model.parameters()).device; rt.setup(loader) moves every batch for you",
        "print(gk.placement(model)) shows where every parameter and buffer lives: a layer "
        "added after model.to(device), or a tensor kept as a plain attribute instead of a "
        "registered buffer, stays behind",
    ]
    if index_fix:
        fixes.insert(0, "move the index to the tensor it indexes: t[idx.to(t.device)]")
    return CrossDeviceError(_say(f"tensors on different devices: {what}", why, fixes))
