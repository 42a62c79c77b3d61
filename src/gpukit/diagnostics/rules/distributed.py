"""Failed and timed-out collectives, in words: NCCL's result codes and watchdog timeouts, gloo's
timeouts and lost peers, an unreachable rendezvous store, with the rank, the collective and the
limit read from the message (see ``gpukit.diagnostics.readable``)."""

from __future__ import annotations

import re

import torch

from gpukit._util import placement
from gpukit._util.text import explained as _say
from gpukit.errors import DistributedError, GpukitError

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


def distributed(text: str, err: BaseException) -> GpukitError | None:
    """A :class:`~gpukit.errors.DistributedError` for the message ``text`` of ``err``, a failed
    or timed-out collective (NCCL, gloo, the rendezvous store), or None for any other error.

    >>> err = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
    >>> print(str(distributed(str(err), err)).splitlines()[0])
    collective failed: the connection to another rank at 127.0.0.1:29500 was closed (gloo)
    """
    backend_error = getattr(torch.distributed, "DistBackendError", None)
    if not _DIST.search(text) and not (backend_error and isinstance(err, backend_error)):
        return None
    rank = _RANK.search(text)
    try:  # a message without "[Rank N]" was still raised on this process's rank
        launched = placement.launched()
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
