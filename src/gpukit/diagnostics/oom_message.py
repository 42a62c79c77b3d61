"""PyTorch's out-of-memory messages read into numbers: how much was asked for, how much the
device holds and has free, and who holds the rest.

:func:`parse` knows the CUDA allocator's current format (torch >= 2.1) and the older
``(GPU 0; ... total capacity; ...)`` one, the CPU allocator's and Apple MPS's; :func:`is_oom`
tells an out-of-memory error from any other. Apart from the explanation
(:mod:`gpukit.diagnostics.oom`), since the formats change with torch's versions while the
advice does not, and the planner's remedies read these numbers too.

>>> parse("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
...       "23.65 GiB of which 1.02 GiB is free.").free == int(1.02 * 2**30)
True
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Literal

import torch

from gpukit._util.text import described
from gpukit.errors import ConfigError, OutOfMemory

OomFormat = Literal["current", "pre-2.1", "cpu", "mps"]

#: torch's out-of-memory exception class (``torch.OutOfMemoryError`` only exists on newer torch).
OOM_ERROR: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# c10's format_size writes "bytes" up to 1 KiB, then KiB/MiB/GiB; MPS's allocator writes
# KB/MB/GB but divides by 1024 as well, so every unit here is binary.
_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_UNIT |= {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
_S = r"([0-9]+(?:\.[0-9]+)?) ?(bytes|B|KiB|KB|MiB|MB|GiB|GB|TiB|TB)\b"
_DETECT = re.compile(
    r"(?:CUDA|HIP) out of memory|MPS backend out of memory"
    r"|DefaultCPUAllocator: (?:not enough memory|can't allocate memory)"
    # Allocations outside the caching allocator: cuBLAS/cuDNN workspaces, NCCL buffers.
    r"|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED"
)
_REQUESTED = re.compile(rf"[Tt]ried to allocate {_S}")
_GPU = re.compile(r"GPU ([0-9]+)(?: has|;)")
_CURRENT = re.compile(rf"total capacity of {_S} of which {_S} is free")
_OLD = re.compile(  # "cached" is torch 1.0-1.3's word for reserved but unallocated
    rf"\(GPU [0-9]+; {_S} total capacity; {_S} already allocated; {_S} free;(?: {_S} allowed;)?"
    rf" {_S} (reserved in total by PyTorch|cached)\)"
)
_THIS = re.compile(rf"this process has {_S} memory in use")
_PROCESS = re.compile(rf"Process ([0-9]+) has {_S} memory in use")
_ALLOCATED = re.compile(rf"Of the allocated memory {_S} is allocated by PyTorch")
_CACHED = re.compile(rf"and {_S} is reserved by PyTorch but unallocated")
_MPS = re.compile(rf"MPS allocated: {_S}, other allocations: {_S}, max allowed: {_S}\)")
_CPU = re.compile(r"you tried to allocate ([0-9]+) bytes")
_WINDOW = 8000  # one message with dozens of process lines fits; bounds regex work on huge text


@dataclass(frozen=True)
class OomNumbers:
    """The numbers of one out-of-memory message, in bytes; None where the message does not say.

    ``other_processes`` sums the listed processes that are not this one. Inside a container
    torch cannot tell which listed pid is itself; then the one holding at least PyTorch's
    reservation, and closest to it, is taken to be this process. Without a process list it is
    ``total - free - this_process``. MPS's ``free`` is its cap minus this process's use.

    >>> parse("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 1; 10.76 GiB total "
    ...       "capacity; 9.12 GiB already allocated; 51.69 MiB free; 9.45 GiB reserved in "
    ...       "total by PyTorch)").device
    'cuda:1'
    """

    device: str | None = None
    requested: int | None = None
    total: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    this_process: int | None = None
    other_processes: int | None = None
    processes: tuple[tuple[int, int], ...] = ()
    format: OomFormat = "current"


def _bytes(number: str, unit: str) -> int:
    # Decimal, so "79.15 GiB" becomes the same integer on every platform.
    return int((Decimal(number) * _UNIT[unit]).to_integral_value())


def _sizes(match: re.Match[str] | None, count: int) -> list[int | None]:
    if match is None:
        return [None] * count
    g = match.groups()
    return [None if g[i] is None else _bytes(g[i], g[i + 1]) for i in range(0, 2 * count, 2)]


def _others(
    used: int | None, this: int | None, sizes: list[int], reserved: int | None
) -> int | None:
    if this is not None:  # torch named this process itself, so every listed pid is another one
        return sum(sizes) if sizes or used is None else max(0, used - this)
    if not sizes:
        return None
    # This process holds PyTorch's reservation plus its CUDA context.
    mine = [b for b in sizes if reserved is not None and b >= reserved]
    return sum(sizes) - (min(mine) if mine else max(sizes))


def parse(message: str) -> OomNumbers | None:
    """The numbers in an out-of-memory message, or None when it is not one gpukit can read.

    Text before the message (an exception's type) and after it (a C++ frame trace) is ignored.

    >>> n = parse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. "
    ...           "GPU 0 has a total capacity of 79.15 GiB of which 12.75 MiB is free.")
    >>> n.requested == 20 * 2**20, n.format
    (True, 'current')
    """
    found = _DETECT.search(message)
    if found is None:
        return None
    text = message[found.start() : found.start() + _WINDOW]
    (requested,) = _sizes(_REQUESTED.search(text), 1)
    if text.startswith("DefaultCPUAllocator"):
        cpu = _CPU.search(text)
        return OomNumbers("cpu", int(cpu[1]) if cpu else None, format="cpu")
    if text.startswith("MPS"):
        allocated, other, allowed = _sizes(_MPS.search(text), 3)
        if allowed is None or allocated is None or other is None:
            return None if requested is None else OomNumbers("mps", requested, format="mps")
        mine = allocated + other  # "other allocations" are this process's, not tensors
        return OomNumbers(
            "mps", requested, allowed, max(0, allowed - mine), allocated, None, mine, format="mps"
        )
    gpu = _GPU.search(text)
    device = f"cuda:{gpu[1]}" if gpu else None  # ROCm's torch names its GPUs cuda too
    old = _OLD.search(text)
    if old is not None:
        size, used, left, _allowed, reserved = _sizes(old, 5)
        unused = reserved if old[11] == "cached" else max(0, (reserved or 0) - (used or 0))
        return OomNumbers(device, requested, size, left, used, unused, format="pre-2.1")
    total, free = _sizes(_CURRENT.search(text), 2)
    (allocated,) = _sizes(_ALLOCATED.search(text), 1)
    (unused,) = _sizes(_CACHED.search(text), 1)
    (this,) = _sizes(_THIS.search(text), 1)
    procs = tuple((int(m[1]), _bytes(m[2], m[3])) for m in _PROCESS.finditer(text))
    if all(v is None for v in (requested, total, free, allocated, unused, this)) and not procs:
        return None
    reserved = None if allocated is None or unused is None else allocated + unused
    used = None if total is None or free is None else total - free
    others = _others(used, this, [b for _, b in procs], reserved)
    return OomNumbers(device, requested, total, free, allocated, unused, this, others, procs)


def is_oom(err: BaseException | str) -> bool:
    """True for torch's out-of-memory error, or a RuntimeError or text in one of its formats.

    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")), is_oom("oops")
    (True, False)
    """
    if isinstance(err, OOM_ERROR | OutOfMemory):
        return True
    if isinstance(err, str | RuntimeError):
        return _DETECT.search(str(err)) is not None
    if isinstance(err, BaseException):
        return False
    raise ConfigError(f"is_oom() takes an exception or its message (str); got {described(err)}")
