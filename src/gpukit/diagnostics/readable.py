"""Raw torch, CUDA, cuDNN, NCCL and gloo errors translated into readable gpukit errors.

:func:`explain_error` recognises the messages of errors gpukit knows (tensors on different
devices, device-side asserts, cuDNN failures, a GPU the build has no kernels for, an old driver,
failed or timed-out collectives, out of memory) and returns a :class:`~gpukit.errors.GpukitError`
that says what happened, with the specifics read from the message, why, and how to fix it.
Text around the message (an exception's type, a C++ frame trace) is ignored.
:func:`reraise_readable` raises that translation from the original, which stays its
``__cause__``. The messages are read by the rules in ``gpukit.diagnostics.rules``, one module
per family: ``cuda`` (the CUDA stack's own failures), ``devices`` (tensors on different
devices), ``distributed`` (NCCL, gloo), ``sharded`` (DTensors met by plain tensors); this
module only tries them in order.

>>> from gpukit.diagnostics.readable import explain_error
>>> err = explain_error(RuntimeError("Expected all tensors to be on the same device, but found "
...     "at least two devices, cuda:0 and cpu! (when checking argument for argument mat1 in "
...     "method wrapper_CUDA_addmm)"))
>>> print(str(err).splitlines()[0])
tensors on different devices: addmm got tensors on cuda:0 and cpu (argument 'mat1')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from gpukit._util.text import described
from gpukit.diagnostics import oom, oom_message
from gpukit.diagnostics.rules.cuda import cudnn, device_assert, driver, no_kernel
from gpukit.diagnostics.rules.devices import cross_device
from gpukit.diagnostics.rules.distributed import distributed
from gpukit.diagnostics.rules.sharded import mixed_dtensor
from gpukit.errors import ConfigError, GpukitError, OutOfMemory

_LIMIT = 50_000  # a DataLoader worker's message holds a whole traceback; bounds regex work

_RULES: tuple[Callable[[str, BaseException], GpukitError | None], ...] = (
    # The root cause first: an assert or a missing kernel also breaks NCCL and cuDNN calls.
    lambda text, err: device_assert(text),
    lambda text, err: no_kernel(text),
    lambda text, err: driver(text),
    lambda text, err: cudnn(text),
    lambda text, err: cross_device(text),
    lambda text, err: mixed_dtensor(text),
    distributed,
)


def explain_error(err: BaseException) -> GpukitError | None:
    """A readable gpukit error for a raw torch/CUDA/cuDNN/NCCL/gloo error, or None when gpukit
    does not know it. A :class:`GpukitError` comes back unchanged; out of memory becomes
    :class:`~gpukit.errors.OutOfMemory` with :func:`gpukit.explain`'s report. Raise the result
    ``from err`` to keep the raw error as its ``__cause__`` (:func:`reraise_readable` does).

    >>> err = explain_error(RuntimeError("[Rank 1] Watchdog caught collective operation "
    ...     "timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, "
    ...     "Timeout(ms)=600000) ran for 600123 milliseconds before timing out."))
    >>> print(str(err).splitlines()[0])
    collective failed: rank 1: ALLREDUCE (collective #5) timed out: it ran 600123 ms, ...
    >>> explain_error(ValueError("bad value")) is None
    True
    """
    if isinstance(err, GpukitError):
        return err
    if not isinstance(err, BaseException):
        hint = " (gk.explain takes an out-of-memory message as text)"
        hint = hint if isinstance(err, str) else ""
        raise ConfigError(
            f"explain_error() takes the exception itself; got {described(err)}: pass the "
            f"caught exception (except Exception as err: gk.explain_error(err)){hint}"
        )
    if not isinstance(err, Exception):
        return None  # KeyboardInterrupt, SystemExit: never a torch failure to explain
    if oom_message.is_oom(err):
        return OutOfMemory(str(oom.explain(err)))
    if not isinstance(err, (RuntimeError, IndexError)):
        # torch raises these failures as RuntimeError (DistBackendError, AcceleratorError are
        # ones) or, for indices on the wrong device, IndexError; an OSError that merely
        # mentions a reset connection is the network's business, not a collective's.
        return None
    text = str(err)[:_LIMIT]
    for rule in _RULES:
        readable = rule(text, err)
        if readable is not None:
            return readable
    return None


def reraise_readable(err: BaseException) -> NoReturn:
    """Raise :func:`explain_error`'s translation from ``err``, or ``err`` itself when there is
    none; use it in an ``except`` block.

    >>> try:
    ...     try:
    ...         raise RuntimeError("CUDA error: no kernel image is available for execution on "
    ...                            "the device")
    ...     except RuntimeError as raw:
    ...         reraise_readable(raw)
    ... except GpukitError as err:
    ...     print(type(err).__name__, type(err.__cause__).__name__)
    NoKernelImageError RuntimeError
    """
    readable = explain_error(err)
    if readable is None or readable is err:
        raise err
    raise readable from err
