"""Raw torch, CUDA, cuDNN, NCCL and gloo errors translated into readable gpukit errors.

:func:`explain_error` recognises the messages of errors gpukit knows (tensors on different
devices, device-side asserts, cuDNN failures, a GPU the build has no kernels for, an old driver,
failed or timed-out collectives, out of memory) and returns a :class:`~gpukit.errors.GpukitError`
that says what happened, with the specifics read from the message, why, and how to fix it.
Text around the message (an exception's type, a C++ frame trace) is ignored.
:func:`reraise_readable` raises that translation from the original, which stays its
``__cause__``. The CUDA stack's own failures are read in ``gpukit._cuda_errors``.

>>> from gpukit.diagnostics.readable import explain_error
>>> err = explain_error(RuntimeError("Expected all tensors to be on the same device, but found "
...     "at least two devices, cuda:0 and cpu! (when checking argument for argument mat1 in "
...     "method wrapper_CUDA_addmm)"))
>>> print(str(err).splitlines()[0])
tensors on different devices: addmm got tensors on cuda:0 and cpu (argument 'mat1')
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NoReturn

import torch

from gpukit import _env
from gpukit._util.text import explained as _say
from gpukit.diagnostics import oom
from gpukit.diagnostics.rules.cuda import _cudnn, _device_assert, _driver, _no_kernel
from gpukit.errors import (
    CrossDeviceError,
    DistributedError,
    GpukitError,
    OutOfMemory,
)

_LIMIT = 50_000  # a DataLoader worker's message holds a whole traceback; bounds regex work
_DEV = r"([a-z_]+(?::[0-9]+)?)"  # cpu, cuda:0, meta, mps; stops before "!", ",", ")"


# --- tensors on different devices -------------------------------------------------------------

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


def _cross_device(text: str) -> GpukitError | None:
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


# --- NCCL and gloo ----------------------------------------------------------------------------

_DIST = re.compile(
    r"NCCL error|\bnccl[A-Z]\w+|Watchdog caught collective operation timeout|gloo/transport"
    r"|Timed out waiting [0-9]+ms for (?:recv|send) operation|Connection (?:closed|reset) by peer"
    r"|client socket has timed out after [0-9]+ms"
)
_RANK = re.compile(r"\bRank ([0-9]+)\]")
_WORK = re.compile(r"SeqNum=([0-9]+), OpType=(\w+)")
_TIMEOUT = re.compile(r"Timeout\(ms\)=([0-9]+)\)(?: ran for ([0-9]+) milliseconds)?")
_GLOO_WAIT = re.compile(r"Timed out waiting ([0-9]+)ms for (recv|send) operation")
_PEER = re.compile(r"Connection (closed|reset) by peer")
_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:([0-9]+)")
_STORE = re.compile(
    r"client socket has timed out after ([0-9]+)ms while trying to connect to \(([^)]*)\)"
)
_NCCL = re.compile(
    r"\b(nccl(?:UnhandledCudaError|SystemError|InternalError|InvalidArgument"
    r"|InvalidUsage|RemoteError))\b"
)
_NCCL_VERSION = re.compile(r"NCCL version ([0-9.]+)")
_LAST = re.compile(r"Last error:\s*\n?([^\n]{1,200})")
_NCCL_WHY = {
    "ncclUnhandledCudaError": "a CUDA call inside NCCL failed: often an earlier CUDA error on "
    "this rank, out of memory, or broken peer-to-peer access between these GPUs",
    "ncclSystemError": "a system call or the network failed inside NCCL (sockets, /dev/shm too "
    "small in a container, InfiniBand)",
    "ncclInternalError": "NCCL failed inside: often a network or topology problem, or "
    "different NCCL versions on different ranks",
    "ncclInvalidArgument": "a collective got arguments NCCL rejects: tensors of different "
    "shapes or dtypes on different ranks, or a tensor not on this rank's GPU",
    "ncclInvalidUsage": "NCCL was used wrongly: two ranks on one GPU (call "
    "torch.cuda.set_device(local_rank) first), or ranks calling different collectives",
    "ncclRemoteError": "another rank exited or the network between the ranks dropped",
}
_NCCL_SAID = (  # NCCL's own words, for a message that lacks the result code's name
    ("unhandled cuda error", "ncclUnhandledCudaError"),
    ("unhandled system error", "ncclSystemError"),
    ("internal error", "ncclInternalError"),
    ("invalid argument", "ncclInvalidArgument"),
    ("invalid usage", "ncclInvalidUsage"),
    ("remote process exited", "ncclRemoteError"),
)
_TIMEOUT_WHY = (
    "the other ranks never joined this collective: one of them crashed or is stuck (a hang, a "
    "slow data loader, work on rank 0 only such as saving), or the ranks called different "
    "collectives (one inside `if rank == 0:`, unequal numbers of batches)"
)


def _ms(value: str) -> str:
    ms = int(value)
    return f"{ms} ms" if ms < 10_000 else f"{ms} ms ({ms / 60_000:g} min)"


def _distributed(text: str, err: BaseException) -> GpukitError | None:
    backend_error = getattr(torch.distributed, "DistBackendError", None)
    if not _DIST.search(text) and not (backend_error and isinstance(err, backend_error)):
        return None
    rank = _RANK.search(text)
    try:  # a message without "[Rank N]" was still raised on this process's rank
        launched = _env.launched()
    except ValueError:  # a malformed RANK must not hide the error being explained
        launched = None
    number = rank[1] if rank else launched.rank if launched else None
    where = "" if number is None else f"rank {number}: "
    work, timeout = _WORK.search(text), _TIMEOUT.search(text)
    gloo_wait, peer, nccl = _GLOO_WAIT.search(text), _PEER.search(text), _NCCL.search(text)
    store = _STORE.search(text)
    why = "a collective failed, usually because another rank failed first"
    if work or timeout:
        op = f"{work[2]} (collective #{work[1]})" if work else "a collective"
        what = f"{where}{op} timed out"
        if timeout:
            ran = f": it ran {timeout[2]} ms," if timeout[2] else ""
            what += f"{ran} the limit is {_ms(timeout[1])}"
        why = _TIMEOUT_WHY
    elif gloo_wait:
        what = f"{where}gloo timed out after {_ms(gloo_wait[1])} waiting to {gloo_wait[2]} data"
        why = _TIMEOUT_WHY
    elif peer:
        address = _ADDRESS.search(text)
        at = f" at {address[1]}:{address[2]}" if address else ""
        what = f"{where}the connection to another rank{at} was {peer[1]} (gloo)"
        why = "that rank's process exited or dropped out: it most likely crashed first"
    elif store:
        what = f"{where}could not reach the rendezvous at ({store[2]}) in {_ms(store[1])}"
        why = "rank 0 has not started its store there, or MASTER_ADDR / MASTER_PORT is wrong"
    else:
        said = next((n for words, n in _NCCL_SAID if words in text), "an NCCL error")
        name = nccl[1] if nccl else said
        version = _NCCL_VERSION.search(text)
        what = f"{where}{name}" + (f" (NCCL {version[1]})" if version else "")
        why = _NCCL_WHY.get(name, why)
        if last := _LAST.search(text):
            what += f": {last[1].strip()}"
    fixes = [
        "read the other ranks' errors first: the first rank to fail is the cause, the others "
        "only waited for it",
        "rerun with NCCL_DEBUG=INFO and TORCH_DISTRIBUTED_DEBUG=DETAIL to see what each rank did"
        if "gloo" not in text
        else "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to see what each rank did",
        "check that every rank calls the same collectives in the same order, with tensors of "
        "the same shape and dtype",
        "gpukit doctor checks NCCL and peer-to-peer access between the GPUs",
    ]
    if work or timeout or gloo_wait:
        fixes.append(
            "if a step is just slow (a first compile, a large checkpoint), raise the timeout: "
            "gk.strategies.DDP(timeout=datetime.timedelta(minutes=30))"
        )
    if store:
        fixes.insert(0, "start rank 0 first, and give every rank the same MASTER_ADDR/PORT")
    return DistributedError(_say(f"collective failed: {what}", why, fixes))


# --- the entry points -------------------------------------------------------------------------

_RULES: tuple[Callable[[str, BaseException], GpukitError | None], ...] = (
    # The root cause first: an assert or a missing kernel also breaks NCCL and cuDNN calls.
    lambda text, err: _device_assert(text),
    lambda text, err: _no_kernel(text),
    lambda text, err: _driver(text),
    lambda text, err: _cudnn(text),
    lambda text, err: _cross_device(text),
    _distributed,
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
    if not isinstance(err, Exception):
        return None  # KeyboardInterrupt, SystemExit: never a torch failure to explain
    if oom.is_oom(err):
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
