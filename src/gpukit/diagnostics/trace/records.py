"""What a trace records: copies (:class:`Transfer`), host waits (:class:`Sync`) and ops per
device, counted by a :class:`Recorder`, and the thread's :data:`state` that says which recorder
the dispatch mode and the wrapped entry points write to.

Everything else in ``gpukit.diagnostics.trace`` imports this module; it imports none of them but
``where``, so the counting has one home and no cycle.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpukit.diagnostics.trace.where import Where, user_frame

TransferKind = Literal["h2d", "d2h", "d2d"]
OpListener = Callable[[Any, tuple[Any, ...], dict[str, Any], Any], None]

HOST = "cpu"
# Copies to or from these move no data; tests stand the meta device in for a GPU by emptying it.
_IGNORED_DEVICE_TYPES: frozenset[str] = frozenset({"meta"})
# Devices the host reads without waiting, and whose ops leave reads of CPU tensors potential
# syncs (see Recorder.syncs); tests stand the meta device in for an accelerator by leaving it out.
_HOST_DEVICE_TYPES: frozenset[str] = frozenset({HOST, "meta"})


@dataclass(frozen=True)
class Transfer:
    """``count`` copies of one kind from one source line, ``bytes`` in total.

    ``pinned``: the host side was page-locked (False for d2d); ``blocking``: copied with
    ``non_blocking=False``; ``src`` and ``dst``: the devices, e.g. ``"cpu"`` and ``"cuda:0"``."""

    kind: TransferKind
    bytes: int
    count: int
    file: str
    line: int
    function: str
    pinned: bool
    blocking: bool
    src: str
    dst: str


@dataclass(frozen=True)
class Sync:
    """``count`` reads of device data by the host, by one op at one source line.

    ``device``: the tensor's device. ``synchronised``: True when it lived on an accelerator, so
    the host really waited; False for a CPU tensor, where nothing waited but the same line
    would once the tensor lives on a GPU (a potential sync)."""

    op: str
    count: int
    file: str
    line: int
    function: str
    device: str
    synchronised: bool


class Recorder:
    """The counts behind one ``gk.trace()``: the dispatch mode and the entry points write them,
    :class:`~gpukit.diagnostics.trace.session.Trace` reads them.

    ``ops``, ``inner`` and ``listeners`` are read by the dispatch mode on every op, so they
    are plain attributes: ``ops`` counts aten ops per device, ``inner`` holds the recorders of
    traces entered inside this one, which see what this one sees while they are active, and
    ``listeners`` the callables that see every op of the mode too, as
    ``listener(op, args, kwargs, out)`` (``out`` None when the op raised): a placement log
    entered inside the trace rides on its dispatch mode rather than adding a second one.

    >>> r = Recorder()
    >>> r.record_transfer(torch.device("cuda:0"), torch.device("cpu"), 4, False, False)
    >>> [(t.kind, t.bytes, t.blocking) for t in r.transfers]
    [('d2h', 4, False)]
    """

    def __init__(self) -> None:
        self.ops: defaultdict[torch.device, int] = defaultdict(int)
        self.inner: list[Recorder] = []
        self.listeners: list[OpListener] = []
        self._transfers: dict[tuple[Any, ...], list[int]] = {}  # key -> [count, bytes]
        self._syncs: dict[tuple[Any, ...], int] = {}

    @property
    def transfers(self) -> list[Transfer]:
        """One per (kind, source line, pinned, blocking, devices), in order of first use."""
        return [Transfer(k[0], b, c, *k[1:]) for k, (c, b) in self._transfers.items()]

    @property
    def syncs(self) -> list[Sync]:
        """One per (op, source line, device), in order of first use. Reads of CPU tensors are
        kept as potential synchronisations only while no op ran on an accelerator: on a GPU
        run they are what they are, host work."""
        found = [Sync(k[0], c, *k[1:]) for k, c in self._syncs.items()]
        if self.used_accelerator:
            found = [s for s in found if s.synchronised]
        return found

    @property
    def used_accelerator(self) -> bool:
        """Whether an op ran on an accelerator: then the host's reads of CPU tensors are host
        work (the data never was on the device), not potential synchronisations."""
        return any(d.type not in _HOST_DEVICE_TYPES for d in self.ops)

    @property
    def ops_per_device(self) -> dict[str, int]:
        """Aten ops run per device: that of the op's first tensor argument, else its output."""
        counts: dict[str, int] = {}
        for dev, n in self.ops.items():
            counts[str(dev)] = counts.get(str(dev), 0) + n
        return counts

    def record_transfer(
        self, src: torch.device, dst: torch.device, nbytes: int, pinned: bool, blocking: bool
    ) -> None:
        """Count one copy of ``nbytes`` from ``src`` to ``dst`` at the user's current line; a
        blocking device-to-host copy is also a synchronisation."""
        kind = _transfer_kind(src, dst)
        if kind is None:
            return
        where, _ = user_frame()
        key = (kind, *where, pinned and kind != "d2d", blocking, str(src), str(dst))
        for recorder in (self, *self.inner):
            entry = recorder._transfers.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        if kind == "d2h" and blocking:  # the host waits until the device's queue drains
            self.record_sync("d2h-copy", src, where)

    def record_sync(
        self, op: str, device: torch.device, where: Where | None = None, *, host_work: bool = False
    ) -> None:
        """Count one read of ``device``'s data by the host, named ``op``, at ``where`` (by
        default the user's current line). ``host_work``: a read of host memory by this op is
        host work on any run, not even a potential sync (a CPU tensor used as a Python index:
        on a GPU run it is on the CPU too), and is not counted."""
        on_host = device.type in _HOST_DEVICE_TYPES
        if on_host and host_work:
            return
        if where is None:
            where, host_side = user_frame()
            if on_host and host_side:
                return  # torch's own host-side bookkeeping: on the CPU on GPU runs too
        key = (op, *where, str(device), not on_host)
        for recorder in (self, *self.inner):
            recorder._syncs[key] = recorder._syncs.get(key, 0) + 1


def pinned(t: torch.Tensor) -> bool:
    """Whether ``t`` is host memory that is page-locked, which copies faster and asynchronously.

    >>> pinned(torch.ones(1))
    False
    """
    return t.device.type == HOST and t.is_pinned()


def _transfer_kind(src: torch.device, dst: torch.device) -> TransferKind | None:
    """What a copy from ``src`` to ``dst`` is; None when it moves nothing between devices.

    >>> _transfer_kind(torch.device("cpu"), torch.device("cuda:0"))
    'h2d'
    >>> _transfer_kind(torch.device("cuda:0"), torch.device("cuda:1"))
    'd2d'
    >>> _transfer_kind(torch.device("cuda:0"), torch.device("cuda:0")) is None
    True
    """
    if src == dst or src.type in _IGNORED_DEVICE_TYPES or dst.type in _IGNORED_DEVICE_TYPES:
        return None
    if src.type == HOST:
        return None if dst.type == HOST else "h2d"
    return "d2h" if dst.type == HOST else "d2d"


class ThreadState(threading.local):
    """Per thread: the recorder of the trace active here, and whether a wrapped entry point is
    running (what it does inside is part of it, not recorded again)."""

    recorder: Recorder | None = None
    busy = False


state = ThreadState()
