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

    # True where running the same thing again fails the same way (bad input, a disk that
    # cannot take the checkpoint): gpukit's launcher does not restart a job for such an error.
    will_repeat = False


class DeviceError(GpukitError, ValueError):
    """A device spec that is malformed, names a missing device, or asks for what the build lacks.

    It is also a ``ValueError``, so code that already catches torch's ``ValueError`` for a bad
    device string keeps working.
    """

    will_repeat = True


def warn_user(message: str) -> None:
    """``warnings.warn`` attributed to the first caller outside gpukit, so the warning names
    the user's line however deep inside gpukit it was raised. Under several processes only
    rank 0 warns: what gpukit warns about (a checkpoint folder, a setting) is the same on every
    rank, and N copies of one line bury it."""
    if not _rank_zero():
        return
    import torch

    # torch's frames too: a hook gpukit put on the user's model is called from torch's
    # Module.__call__ (and compiled code's), which is no line of the user's.
    inside = (_PACKAGE_DIR, str(Path(torch.__file__).resolve().parent))
    level = 2  # 1 is this function's own warnings.warn line, 2 its caller
    frame = sys._getframe(1)
    while frame is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(inside):
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
        level += 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _rank_zero() -> bool:
    """Whether this process is rank 0 of its process group, or in none (a launched rank joins
    its group as its Runtime is made, before gpukit has anything to warn about)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class ConfigError(GpukitError, ValueError):
    """A setting that is not allowed: an unknown strategy, precision or workload, a batch too
    small for the ranks, a missing checkpoint, a port in use, a folder another run holds."""

    will_repeat = True


class OutputWriteError(GpukitError, OSError):
    """A file gpukit writes could not be written (``metrics.csv``, ``metrics.json``, a plot,
    ``config.toml``, a logger's files, a report, a lock, the launcher's job folder): the disk
    is full (ENOSPC), a file would pass the size limit (EFBIG), the folder is not writable
    (EACCES, EPERM), is on a read-only file system (EROFS), or a folder stands where the file
    goes (EISDIR). The message names the file, the errno and the fix; ``path`` is the file
    and ``errno`` the one underneath. A file gpukit replaces whole is written aside and renamed,
    so the previous one is still there, whole; an appended file is cut back to its last whole
    line. Only the process that writes the file raises it (rank 0 for the run's shared files).

    Restarting would fail the same way, so gpukit's launcher does not restart a job for it.
    It is also an ``OSError``, so code that already catches write errors keeps working.
    """

    will_repeat = True
    path: str | None = None


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written: the disk is full (ENOSPC), a file would pass the size
    limit (EFBIG), the folder is not writable (EACCES, EPERM) or is on a read-only file system
    (EROFS). The message names the folder, the bytes the checkpoint needs and those free there,
    and the fix. Nothing of the failed save is left behind and ``latest`` still names the
    previous checkpoint. Every rank raises it; ``errno`` is the one underneath when known.

    Restarting would fail the same way, so gpukit's launcher does not restart a job for it.
    It is also an ``OSError``, so code that already catches write errors keeps working.
    """

    will_repeat = True


class OutOfMemory(GpukitError, RuntimeError):
    """A device ran out of memory; the message explains it in numbers and ranks the remedies
    (see ``gpukit.explain``). The original ``torch.OutOfMemoryError`` is its ``__cause__``; like
    it, this is a ``RuntimeError``, so ``except RuntimeError`` code keeps catching it."""


class LoggerError(GpukitError, RuntimeError):
    """A logger given to ``gk.Runtime(loggers=...)`` failed (a full disk, a tracker that
    refused a value): the message names the logger and the call, and the run stops rather than
    train on without its log. The logger's own error is the ``__cause__``; ``rt.history``
    still holds every record."""


class LoggerWriteError(LoggerError, OutputWriteError):
    """A logger's files could not be written (a full disk, a read-only folder): a
    :class:`LoggerError` naming the logger and the call, and an :class:`OutputWriteError`
    naming the file, the errno and the fix, which gpukit's launcher does not restart."""

    will_repeat = True


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


class Preempted(SystemExit):
    """The run was asked to stop (SIGTERM or SIGINT: a scheduler's preemption, Ctrl-C) and
    stopped at a step every rank reached, after saving a checkpoint there. The message says
    where it was saved and how to resume.

    Like ``KeyboardInterrupt`` it is not an ``Exception``: a loop's ``except Exception`` does
    not swallow the stop. It is a ``SystemExit`` with code ``exit_code`` (143, as a process
    ended by SIGTERM reports), so a plain ``python train.py`` or a torchrun rank exits with it
    after rank 0 printed the message once.

    >>> import gpukit as gk
    >>> err = gk.Preempted("stopped after step 5")
    >>> err.code, str(err), isinstance(err, Exception)
    (143, 'stopped after step 5', False)
    """

    exit_code = 143

    def __init__(self, message: str) -> None:
        super().__init__(self.exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[Preempted], tuple[str]]:
        return (type(self), (self.message,))


class NonFiniteError(GpukitError, RuntimeError):
    """The loss or the gradients held NaN or Inf (``Runtime(nonfinite="raise")``), or too many
    steps in a row did under ``nonfinite="skip"``; the message names the step and the rank."""


class RunComplete(GpukitError):
    """A resumed run has nothing left to train: its checkpoint is already at (or past) the
    last step asked for. ``gpukit train --resume`` says so and exits 0, leaving ``--out`` as
    it was; the message says how to train further.

    >>> import gpukit as gk
    >>> gk.RunComplete("already complete at step 5 of 5").will_repeat
    True
    """

    will_repeat = True


class SimulationUnsupported(GpukitError):
    """The planner's simulation cannot run this case (the message says which part and why);
    ``gk.plan`` then answers with the closed form and says so in the plan's notes."""
