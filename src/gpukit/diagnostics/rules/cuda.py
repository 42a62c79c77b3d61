"""The CUDA stack's own failures, in words: device-side asserts, cuDNN errors, a GPU the torch
build has no kernels for, a driver older than the build's CUDA (see
``gpukit.diagnostics.readable``). Each rule takes an error's message and returns a readable
error, or None when the message is not of its kind."""

from __future__ import annotations

import contextlib
import re

import torch

from gpukit._util.text import explained as _say
from gpukit.errors import (
    CudnnError,
    DeviceAssertError,
    DriverTooOldError,
    GpukitError,
    NoKernelImageError,
)

# --- device-side assert -----------------------------------------------------------------------

_ASSERT = re.compile(r"device-side assert(?:ion)? triggered|block: \[[0-9,]+\], thread: \[")
_KERNEL = re.compile(
    r"([\w.-]+\.cuh?):([0-9]+): ([^\n]{1,300}?): block: \[[0-9,]+\], thread: \[[0-9,]+\] "
    r"Assertion `(.{1,300}?)` failed"
)
_KINDS = (  # (words in the assertion, what it means, the likely cause, the fix)
    (
        ("n_classes", "n_class"),
        "class targets outside [0, num_classes)",
        "cross_entropy / nll_loss got a target below 0 or at least the number of classes (the "
        "size of the model's last layer)",
        "check the labels: compare y.min() and y.max() with the output size; labels 1..C need "
        "y - 1, and -100 is the only negative cross_entropy ignores by default",
    ),
    (
        ("index out of bounds", "srcIndex <", "index < ", "idx_dim"),
        "an index out of range",
        "an index (t[idx], gather, index_select, or nn.Embedding given a token id >= "
        "num_embeddings) is outside the indexed dimension",
        "check the indices' range: for an embedding, every token id must be below "
        "num_embeddings (a tokenizer's vocabulary larger than the model's is the usual case)",
    ),
    (
        ("input_val >= zero",),
        "binary_cross_entropy inputs outside [0, 1]",
        "binary_cross_entropy takes probabilities, and got a value outside [0, 1] (raw logits)",
        "give raw logits to nn.BCEWithLogitsLoss instead, which is also numerically stabler",
    ),
)


def device_assert(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.DeviceAssertError` naming the kernel, the assertion and its
    likely cause (class targets, an index), or None.

    >>> print(str(device_assert("CUDA error: device-side assert triggered")).splitlines()[0])
    a CUDA kernel failed a device-side assertion
    """
    if not _ASSERT.search(text):
        return None
    kernel = _KERNEL.search(text)
    kind = None
    if kernel:
        kind = next((k for k in _KINDS if any(w in kernel[4] for w in k[0])), None)
    what = "a CUDA kernel failed a device-side assertion"
    if kind:
        what += f": {kind[1]}"
    if kernel:
        what += f" ({kernel[3]} at {kernel[1]}:{kernel[2]}: `{kernel[4]}`)"
    why = (
        "CUDA kernels run asynchronously, so the failure is reported at a later CUDA call: the "
        "line in the traceback may not be the one that failed. "
    )
    why += (
        kind[2]
        if kind
        else "The usual cause is class targets outside [0, num_classes) in cross_entropy / "
        "nll_loss, or an index out of range (nn.Embedding with a token id >= num_embeddings)"
    )
    fixes = [
        "rerun with gpukit trace --blocking script.py (or CUDA_LAUNCH_BLOCKING=1 python "
        "script.py) to see the line that failed; one batch on the CPU raises a readable error",
        kind[3]
        if kind
        else "check the targets' range against the number of classes, and "
        "every index (token ids, t[idx]) against the size it indexes",
        "the CUDA context is now unusable, every later CUDA call fails: restart the process "
        "(or the notebook's kernel)",
    ]
    return DeviceAssertError(_say(what, why, fixes))


# --- cuDNN ------------------------------------------------------------------------------------

_CUDNN = re.compile(r"CUDNN_STATUS_([A-Z_]+)|cuDNN version (?:incompatibility|mismatch)")
_CUDNN_VERSIONS = re.compile(
    r"compiled\s+against\s+(\([0-9, ]+\)|[0-9]+)\s+but\s+(?:found runtime version|linked against)"
    r"\s+(\([0-9, ]+\)|[0-9]+)"
)
_CUDNN_WHY = {
    "NOT_INITIALIZED": "cuDNN could not start: most often the GPU was out of memory when cuDNN "
    "created its handle, or the driver / CUDA installation is broken",
    "ALLOC_FAILED": "cuDNN could not allocate its workspace: the GPU is out of memory",
    "EXECUTION_FAILED": "a cuDNN kernel failed on the GPU: often out of memory, an earlier "
    "asynchronous CUDA error, or a driver that does not match the CUDA runtime",
    "MAPPING_ERROR": "cuDNN could not access GPU memory: usually an earlier illegal memory "
    "access or a driver problem",
    "INTERNAL_ERROR": "cuDNN failed inside: often out of memory or a driver problem",
    "NOT_SUPPORTED": "cuDNN has no kernel for this layer's configuration (shape, dtype, memory "
    "layout): a huge batch (over 2**31 elements), a non-contiguous input or an unusual dtype",
    "BAD_PARAM": "cuDNN rejected this layer's configuration (shape, dtype, memory layout)",
    "ARCH_MISMATCH": "this cuDNN does not support the GPU's architecture",
}


def _cudnn_version(raw: str) -> str:
    if raw.startswith("("):
        return ".".join(p.strip() for p in raw.strip("()").split(","))
    n = int(raw)  # cuDNN 8 encodes 8.9.7 as 8907, cuDNN 9 encodes 9.1.0 as 90100
    major, rest = (n // 10000, n % 10000) if n >= 90000 else (n // 1000, n % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def cudnn(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.CudnnError` for a ``CUDNN_STATUS_*`` failure or a cuDNN version
    mismatch, or None.

    >>> print(str(cudnn("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")).splitlines()[0])
    cuDNN failed: CUDNN_STATUS_NOT_SUPPORTED
    """
    m = _CUDNN.search(text)
    if m is None:
        return None
    versions = _CUDNN_VERSIONS.search(text)
    confirm = (
        "torch.backends.cudnn.enabled = False at the top of the script: if the error goes "
        "away, cuDNN is the culprit (training is slower without it)"
    )
    doctor = "gpukit doctor checks the driver, CUDA runtime and cuDNN that torch loads"
    if versions or m[1] is None:
        built = _cudnn_version(versions[1]) if versions else "one version"
        found = _cudnn_version(versions[2]) if versions else "another"
        what = f"cuDNN version mismatch: torch was built against {built} but loaded {found}"
        why = (
            "torch comes with its own cuDNN, and another one on the library path "
            "(LD_LIBRARY_PATH, a conda environment, a system install) was loaded instead"
        )
        fixes = [
            "remove the other cuDNN from LD_LIBRARY_PATH (or the environment), or reinstall "
            "the torch wheel in a clean virtual environment",
            doctor,
        ]
        return CudnnError(_say(what, why, fixes))
    status = m[1]
    why = _CUDNN_WHY.get(status, "cuDNN failed with this status")
    fixes = [doctor, confirm, "reinstall the torch wheel if the installation is broken"]
    if status in ("NOT_INITIALIZED", "ALLOC_FAILED", "EXECUTION_FAILED", "INTERNAL_ERROR"):
        fixes.insert(0, "if the GPU is nearly full, try a smaller batch (print(gk.memory()))")
    if status in ("NOT_SUPPORTED", "BAD_PARAM"):
        fixes[:0] = ["make the input contiguous (x.contiguous()) or the batch smaller"]
    return CudnnError(_say(f"cuDNN failed: CUDNN_STATUS_{status}", why, fixes))


# --- no kernel image --------------------------------------------------------------------------

_NO_KERNEL = re.compile(r"no kernel image is available")
_SM = re.compile(r"with CUDA capability sm_([0-9]+)")
_SUPPORTS = re.compile(r"supports CUDA capabilities ((?:sm_[0-9]+a?\s*)+)")


def _cuda_build() -> tuple[str | None, tuple[int, int] | None, list[str]]:
    """The current GPU's name and capability, and the build's architectures, as far as torch
    can still tell: after a CUDA error some queries fail, and a CPU build knows none."""
    name, capability, arches = None, None, []
    with contextlib.suppress(Exception):
        arches = list(torch.cuda.get_arch_list())
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            major, minor = torch.cuda.get_device_capability(index)
            capability, name = (major, minor), torch.cuda.get_device_name(index)
    return name, capability, arches


def no_kernel(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.NoKernelImageError` naming the GPU's architecture and the
    build's, or None.

    >>> no_kernel("CUDA error: out of memory") is None
    True
    """
    if not _NO_KERNEL.search(text):
        return None
    name, capability, arches = _cuda_build()
    sm = f"sm_{capability[0]}{capability[1]}" if capability else None
    if m := _SM.search(text):  # the message's own words beat a query after the failure
        sm = f"sm_{m[1]}"
    if m := _SUPPORTS.search(text):
        arches = m[1].split()
    gpu = f"the GPU ({name}, {sm})" if name and sm else f"the GPU ({sm})" if sm else "the GPU"
    built = f"kernels for {' '.join(arches)}" if arches else "kernels for other architectures"
    what = f"no kernel image for {gpu}: this torch build has {built}"
    why = (
        "torch ships compiled kernels only for the GPU architectures chosen when it was built; "
        "a GPU newer than the wheel (e.g. Blackwell, sm_100/sm_120, on a wheel before cu128) "
        "or one old enough to be dropped from it has none"
    )
    target = sm or "your GPU's architecture"
    fixes = [
        f"install a torch build that includes {target}: for a new GPU a wheel built with a "
        "newer CUDA (https://pytorch.org/get-started/locally), for an old one an older torch "
        "or a source build with TORCH_CUDA_ARCH_LIST",
        "gpukit doctor shows the GPU's compute capability and the build's architectures",
    ]
    return NoKernelImageError(_say(what, why, fixes))


# --- driver too old ---------------------------------------------------------------------------

_DRIVER = re.compile(
    r"driver on your system is too old(?: \(found version ([0-9]+)\))?"
    r"|CUDA driver version is insufficient for CUDA runtime version"
)
_WHEEL = {11: "cu118", 12: "cu126"}  # one wheel per CUDA major version the driver may run


def driver(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.DriverTooOldError` with the CUDA version the driver supports
    and a wheel that runs on it, or None.

    >>> print(str(driver("The NVIDIA driver on your system is too old (found version 11040)."
    ...     )).splitlines()[0])
    the NVIDIA driver supports CUDA up to 11.4...
    """
    m = _DRIVER.search(text)
    if m is None:
        return None
    built = torch.version.cuda
    what = "the NVIDIA driver is too old for this torch"
    major = None
    if m[1]:
        found = int(m[1])  # CUDA encodes 11.4 as 11040
        major = found // 1000
        what = f"the NVIDIA driver supports CUDA up to {major}.{found % 1000 // 10}"
        what += f" but this torch was built for CUDA {built}" if built else ", too old for torch"
    why = (
        "each CUDA version needs a driver at least as new; torch's CUDA runtime is newer than "
        "what the installed driver supports"
    )
    wheel = _WHEEL.get(major) if major else None
    older = (
        f"install a torch built for CUDA {major}.x: pip install torch --index-url "
        f"https://download.pytorch.org/whl/{wheel}"
        if wheel
        else "install a torch built for an older CUDA (e.g. the cu118 wheel)"
    )
    fixes = [
        "update the NVIDIA driver (nvidia-smi shows its version and the newest CUDA it runs)",
        older,
        "gpukit doctor compares the driver with the CUDA version torch needs",
    ]
    return DriverTooOldError(_say(what, why, fixes))
