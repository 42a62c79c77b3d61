"""The errors gpukit raises for mistakes a user can fix.

Every message says what was given, what exists or is allowed, and how to fix it. The CLI prints
a :class:`GpukitError` in one or two lines, without a traceback, and exits with code 2.

>>> import gpukit as gk
>>> try:
...     gk.device("tpu:0")
... except gk.GpukitError as err:
...     print(type(err).__name__)
DeviceError
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


class GpukitError(Exception):
    """Base class of every error gpukit raises on bad input or an impossible request."""


class DeviceError(GpukitError, ValueError):
    """A device spec that is malformed, names a missing device, or asks for what the build lacks.

    It is also a ``ValueError``, so code that already catches torch's ``ValueError`` for a bad
    device string keeps working.
    """


def warn_user(message: str) -> None:
    """``warnings.warn`` attributed to the first caller outside gpukit, so the warning names
    the user's line however deep inside gpukit it was raised. Under several processes only
    rank 0 warns: what gpukit warns about (a checkpoint folder, a setting) is the same on every
    rank, and N copies of one line bury it."""
    if not _rank_zero():
        return
    level = 2  # 1 is this function's own warnings.warn line, 2 its caller
    frame = sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
        _PACKAGE_DIR
    ):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _rank_zero() -> bool:
    """Whether this process is rank 0 of its process group, or in none (a launched rank joins
    its group as its Runtime is made, before gpukit has anything to warn about)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class ConfigError(GpukitError, ValueError):
    """A setting that is not allowed: an unknown strategy, precision or workload, a batch too
    small for the ranks, a missing checkpoint, a port in use."""


class OutOfMemory(GpukitError, RuntimeError):
    """A device ran out of memory; the message explains it in numbers and ranks the remedies
    (see ``gpukit.explain``). The original ``torch.OutOfMemoryError`` is its ``__cause__``; like
    it, this is a ``RuntimeError``, so ``except RuntimeError`` code keeps catching it."""


class LaunchError(GpukitError):
    """A rank of a launched job failed; the message holds its error and traceback."""


# Translations of raw torch/CUDA/NCCL errors (see gpukit.diagnostics.readable). They are
# RuntimeErrors as well, so code that already catches torch's RuntimeError keeps working.


class CrossDeviceError(GpukitError, RuntimeError):
    """One op got tensors on different devices; the message names them and where to move them."""


class DeviceAssertError(GpukitError, RuntimeError):
    """A CUDA kernel failed a device-side assertion (bad class targets, an index out of range)."""


class CudnnError(GpukitError, RuntimeError):
    """cuDNN failed: a status such as CUDNN_STATUS_NOT_INITIALIZED, or a version mismatch."""


class NoKernelImageError(GpukitError, RuntimeError):
    """The GPU's architecture is not among those this torch build was compiled for."""


class DriverTooOldError(GpukitError, RuntimeError):
    """The NVIDIA driver is older than the CUDA version this torch build needs."""


class ShardedTensorError(GpukitError, RuntimeError):
    """A sharded parameter (a DTensor) met a plain tensor outside the module that owns it."""


class DistributedError(GpukitError, RuntimeError):
    """A collective failed or timed out in NCCL or gloo, usually because another rank did."""


class Preempted(GpukitError):
    """The run was asked to stop (SIGTERM or SIGINT: a scheduler's preemption, Ctrl-C) and
    stopped at a step every rank reached, after saving a checkpoint there when it had a folder
    for one. The message says where it was saved and how to resume; ``gpukit train`` and
    ``gpukit launch`` exit with ``exit_code`` (143, as a process ended by SIGTERM reports)."""

    exit_code = 143


class NonFiniteError(GpukitError, RuntimeError):
    """The loss or the gradients held NaN or Inf (``Runtime(nonfinite="raise")``), or too many
    steps in a row did under ``nonfinite="skip"``; the message names the step and the rank."""


class SimulationUnsupported(GpukitError):
    """The planner's simulation cannot run this case (the message says which part and why);
    ``gk.plan`` then answers with the closed form and says so in the plan's notes."""
