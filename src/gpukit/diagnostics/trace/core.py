"""Where a program copies between host and device, and where it makes the host wait for one.

``with trace() as t:`` records, in this thread, every host<->device copy and every hidden
synchronisation (``.item()``, ``print(t)``, ``if t:``, ``.nonzero()``, a blocking ``.cpu()``...),
each attributed to the user's source line; ``t.report()`` ranks them by estimated cost, with a
fix for each. On a CPU-only run nothing waits, but the same lines would on a GPU: those are
reported as potential (``synchronised=False``).

>>> import torch
>>> from gpukit.diagnostics.trace.core import trace
>>> with trace() as t:
...     x = torch.ones(3)
...     total = x.sum().item()
>>> [(s.op, s.count, s.device, s.synchronised) for s in t.syncs]
[('item', 1, 'cpu', False)]
>>> t.ops_per_device["cpu"] >= 2
True

How: a ``TorchDispatchMode`` counts every aten op per device and looks closer only at the few
that copy across devices or read data back (one dict lookup per op). Entry points that never
reach the dispatcher, or reach it as many inner ops, are wrapped while a trace is active:
``Tensor.item/tolist/numpy/__bool__/__float__/__int__/__repr__/__str__/__format__``,
``torch.tensor/as_tensor/asarray`` and ``Tensor.new_tensor`` (a list copied to a device),
``torch.cuda.synchronize``, ``torch.accelerator.synchronize`` and
``torch.cuda.Stream/Event.synchronize``. A thread-local
guard makes one ``print(loss)`` one "print", not also the ``item()`` it does inside.

Attribution goes to the innermost Python frame that is not under torch's package directory,
not under gpukit's (except ``gpukit/workloads/``: the loop that
``gpukit trace --workload`` runs is user code), and not in the standard library (``contextlib``,
``threading``, ``logging``...).
Not reported: copies to or from the ``meta`` device (no data moves; tests treat it as a device
through ``_IGNORED_DEVICE_TYPES``), and reads of CPU tensors by ``torch.optim`` (step counters)
and ``torch.utils.data`` (samplers' random numbers), which stay on the CPU on GPU runs too.
A trace entered inside another (in the same thread) sees what the outer one sees while it is
active; a process forked during a trace (a DataLoader worker) records nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpukit.diagnostics.trace.report import render
from gpukit.diagnostics.trace.where import Where, _user_frame
from gpukit.errors import ConfigError

TransferKind = Literal["h2d", "d2h", "d2d"]


_IGNORED_DEVICE_TYPES: frozenset[str] = frozenset({"meta"})
_HOST = "cpu"


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


class _State(threading.local):
    tracer: Trace | None = None
    busy = False  # inside a wrapped entry point: what it does inside is part of it


_state = _State()

# A process forked while a trace is active (a DataLoader worker) inherits the mode; it must
# only pass ops through there: its records would be lost, and cost every op.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class Trace:
    """What :func:`trace` recorded. Entering it again adds to the same counts."""

    def __init__(self) -> None:
        self._transfers: dict[tuple[Any, ...], list[int]] = {}  # key -> [count, bytes]
        self._syncs: dict[tuple[Any, ...], int] = {}
        self._ops: defaultdict[torch.device, int] = defaultdict(int)
        self._active: contextlib.ExitStack | None = None
        self._inner: list[Trace] = []  # traces entered inside this one: they see the same
        self._outer: Trace | None = None

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
        if any(d.type not in (_HOST, "meta") for d in self._ops):
            found = [s for s in found if s.synchronised]
        return found

    @property
    def ops_per_device(self) -> dict[str, int]:
        """Aten ops run per device: that of the op's first tensor argument, else its output."""
        counts: dict[str, int] = {}
        for dev, n in self._ops.items():
            counts[str(dev)] = counts.get(str(dev), 0) + n
        return counts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"transfers": [Transfer fields], "syncs": [Sync fields],
        "ops_per_device": {device: ops}}``."""
        transfers, syncs = self.transfers, self.syncs
        return {
            "transfers": [asdict(t) for t in transfers],
            "syncs": [asdict(s) for s in syncs],
            "ops_per_device": self.ops_per_device,
        }

    def report(self) -> str:
        """The findings ranked by estimated cost on a GPU, each with its line and a fix.

        Estimates rank, they do not predict: a synchronisation costs ``SYNC_S`` (30 us: the
        10-50 us round trip, while the GPU idles until the host queues work again); a copy
        ``COPY_LAUNCH_S`` (10 us) plus its bytes at 12 GB/s from pageable host memory, 25 GB/s
        from pinned, 50 GB/s between devices, plus ``SYNC_S`` if it is a blocking d2h copy
        (listed once, as a transfer, though ``syncs`` also has it as ``d2h-copy``).

        >>> print(Trace().report())
        gk.trace: 0 ops; no host<->device copies or synchronisations found
        """
        return render(self.ops_per_device, self.transfers, self.syncs)

    def __enter__(self) -> Trace:
        if self._active is not None or self._outer is not None:
            raise ConfigError("this gk.trace() is already active: enter a new gk.trace()")
        outer = _state.tracer
        if outer is not None:
            # Inside another trace (a script traced by `gpukit trace` that traces a part of
            # itself): both see what happens here, through the outer trace's mode.
            self._outer = outer
            outer._inner.append(self)
            return self
        with contextlib.ExitStack() as stack:  # undoes the patches if the mode fails to start
            stack.enter_context(_patched())
            stack.enter_context(_Mode(self))
            self._active = stack.pop_all()
        _state.tracer = self
        return self

    def __exit__(self, *exc: object) -> None:
        outer, self._outer = self._outer, None
        if outer is not None:
            outer._inner.remove(self)
            return
        active, self._active = self._active, None
        if active is not None:
            _state.tracer = None
            active.close()

    def _record_transfer(
        self, src: torch.device, dst: torch.device, nbytes: int, pinned: bool, blocking: bool
    ) -> None:
        kind = _transfer_kind(src, dst)
        if kind is None:
            return
        where, _ = _user_frame()
        key = (kind, *where, pinned and kind != "d2d", blocking, str(src), str(dst))
        for tracer in (self, *self._inner):
            entry = tracer._transfers.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
        if kind == "d2h" and blocking:  # the host waits until the device's queue drains
            self._record_sync("d2h-copy", src, where)

    def _record_sync(self, op: str, device: torch.device, where: Where | None = None) -> None:
        on_host = device.type in (_HOST, "meta")
        if where is None:
            where, host_side = _user_frame()
            if on_host and host_side:
                return  # torch's own host-side bookkeeping: on the CPU on GPU runs too
        key = (op, *where, str(device), not on_host)
        for tracer in (self, *self._inner):
            tracer._syncs[key] = tracer._syncs.get(key, 0) + 1


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Record nothing of what runs inside (gpukit's own one-time reads), in this thread.

    >>> import torch
    >>> with trace() as t:
    ...     with untraced():
    ...         _ = torch.ones(1).item()
    >>> t.syncs
    []
    """
    busy, _state.busy = _state.busy, True
    try:
        yield
    finally:
        _state.busy = busy


def trace() -> Trace:
    """Record host<->device copies and synchronisations in this thread while the block runs.

    >>> import torch
    >>> with trace() as t:
    ...     print(torch.zeros(2))
    tensor([0., 0.])
    >>> [(s.op, s.count) for s in t.syncs]
    [('print', 1)]
    """
    return Trace()


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
    if src.type == _HOST:
        return None if dst.type == _HOST else "h2d"
    return "d2h" if dst.type == _HOST else "d2d"


# --- the dispatch mode -----------------------------------------------------------------------


class _Mode(TorchDispatchMode):
    """Counts every op per device; hands the few copy and read-back ops to the Trace."""

    def __init__(self, tracer: Trace) -> None:
        super().__init__()
        self.tracer = tracer
        self.ops = tracer._ops
        self.pid = _pid[0]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # Run for every op: no frame walk, no strings; one device lookup and two dict lookups.
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self.pid != _pid[0]:
            return out  # a forked child (see _pid)
        first = args[0] if args else out
        if not isinstance(first, torch.Tensor):
            first = _first_tensor(args, out)
        if first is not None:
            self.ops[first.device] += 1
            for inner in self.tracer._inner:
                inner._ops[first.device] += 1
        handler = _WATCHED.get(func)
        if handler is not None and not _state.busy:
            handler(self.tracer, args, kwargs or {}, out)
        return out


def _first_tensor(args: tuple[Any, ...], out: Any) -> torch.Tensor | None:
    for value in (*args, out):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]  # foreach ops, cat, ops with several outputs
    return None


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == _HOST and t.is_pinned()


def _on_copy(src_at: int, dst_at: int | None) -> Callable[..., None]:
    """Handles a copy op with its source and destination at these argument positions (None:
    the output); ``non_blocking`` is the third argument or a keyword."""

    def handle(tr: Trace, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        src, dst = args[src_at], out if dst_at is None else args[dst_at]
        if isinstance(src, torch.Tensor) and src.device != dst.device:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            pinned = _pinned(src) or _pinned(dst) or bool(kwargs.get("pin_memory"))
            tr._record_transfer(src.device, dst.device, dst.nbytes, pinned, blocking)

    return handle


def _on_read(op: str) -> Callable[..., None]:
    def handle(tr: Trace, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        indices = args[1] if op == "mask-index" and len(args) > 1 else None
        if isinstance(indices, (list, tuple)) and not any(_is_mask(i) for i in indices):
            return  # integer indices: the output's shape is known without the data
        if kwargs.get("output_size") is None:  # repeat_interleave with it knows its shape
            tr._record_sync(op, args[0].device)

    return handle


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


_READS = {  # the sync's name -> the aten ops (op.overload) that read data back to the host
    "item": "_local_scalar_dense.default",
    "bool": "is_nonzero.default",
    "equal": "equal.default",
    "allclose": "allclose.default",
    "nonzero": "nonzero.default",
    "mask-index": "masked_select.default index.Tensor index_put_.default index_put.default "
    "_index_put_impl_.default",
    "unique": "_unique2.default _unique.default unique_dim.default unique_consecutive.default",
    "repeat_interleave": "repeat_interleave.Tensor",
}


def _watched_ops() -> dict[Any, Callable[..., None]]:
    def op(spec: str) -> Any:  # getattr: some overloads are missing in older torch
        name, overload = spec.split(".")
        return getattr(getattr(torch.ops.aten, name, None), overload, None)

    found: dict[Any, Callable[..., None]] = {op("_to_copy.default"): _on_copy(0, None)}
    found.update({op(s): _on_copy(1, 0) for s in ("copy_.default", "copy.default")})
    found.update(
        {op(s): _on_copy(0, 1) for s in ("_copy_from.default", "_copy_from_and_resize.default")}
    )
    for name, specs in _READS.items():
        found.update({op(s): _on_read(name) for s in specs.split()})
    found.pop(None, None)
    return found


_WATCHED = _watched_ops()


# --- Python entry points ---------------------------------------------------------------------


def _entry(original: Callable[..., Any], op: str, device_of: Callable[..., Any]) -> Any:
    """``original``, recorded as one ``op`` sync; what it does inside is not recorded."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state = _state
        if state.tracer is None or state.busy:
            return original(*args, **kwargs)
        state.busy = True
        try:
            out = original(*args, **kwargs)
        finally:
            state.busy = False
        tracer = state.tracer  # again: the call may have ended the trace
        if tracer is not None:
            tracer._record_sync(op, device_of(*args, **kwargs))
        return out

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _creation(original: Callable[..., Any], data_at: int = 0) -> Any:
    """``torch.tensor(list, device=...)`` copies without reaching the dispatcher's Python key.

    ``data_at`` is where the data is among the positional arguments: 1 for ``new_tensor``,
    whose first is the tensor it is called on.
    """

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # The copy of a tensor or an array does reach the dispatcher, a list's does not: the
        # wrapper counts every kind once, and the dispatcher's sight of it is muted.
        busy, _state.busy = _state.busy, True
        try:
            out = original(*args, **kwargs)
        finally:
            _state.busy = busy
        tracer = _state.tracer
        if tracer is not None and not busy:
            data = args[data_at] if len(args) > data_at else kwargs.get("data", kwargs.get("obj"))
            src = data.device if isinstance(data, torch.Tensor) else torch.device(_HOST)
            pinned = isinstance(data, torch.Tensor) and _pinned(data)
            tracer._record_transfer(src, out.device, out.nbytes, pinned, True)
        return out

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _sync_device(target: Any = None, *args: Any, **kwargs: Any) -> torch.device:
    """The device a ``synchronize(device)`` or ``stream.synchronize()`` waited for."""
    target = getattr(target, "device", kwargs.get("device", target))  # a stream's, or the arg
    if isinstance(target, (str, torch.device)):
        return torch.device(target)
    with contextlib.suppress(Exception):  # only a label: the call itself has succeeded
        return torch.device("cuda", torch.cuda.current_device() if target is None else target)
    return torch.device("cuda")


_TENSOR_ENTRIES = {"item": "item", "tolist": "tolist", "numpy": "numpy", "__bool__": "bool"}
_TENSOR_ENTRIES.update({"__float__": "float", "__int__": "int"})
_TENSOR_ENTRIES.update(dict.fromkeys(("__repr__", "__str__", "__format__"), "print"))


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, wrapper) for every entry point wrapped during a trace."""
    found: list[tuple[Any, str, Any]] = [
        (torch.Tensor, name, _entry(getattr(torch.Tensor, name), op, lambda t, *_, **__: t.device))
        for name, op in _TENSOR_ENTRIES.items()
    ]
    creators = ("tensor", "as_tensor", "asarray")
    found += [(torch, name, _creation(getattr(torch, name))) for name in creators]
    found.append((torch.Tensor, "new_tensor", _creation(torch.Tensor.new_tensor, data_at=1)))
    owners = [torch.cuda, torch.cuda.Stream, torch.cuda.Event, getattr(torch, "accelerator", None)]
    for owner in owners:
        if owner is not None and callable(getattr(owner, "synchronize", None)):
            sync = owner.synchronize
            found.append((owner, "synchronize", _entry(sync, "synchronize", _sync_device)))
    return found


_patch_lock = threading.Lock()
_patch_users = 0  # traces active in any thread: the wrappers stay while one is


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    """Wrap the entry points, then put back exactly what was there: the owner's own attribute,
    or none where it was inherited (``Tensor.item`` lives on ``TensorBase``)."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            for owner, name, wrapper in _patches():
                _saved.append((owner, name, vars(owner).get(name, _MISSING)))
                setattr(owner, name, wrapper)
                _script_as_original(wrapper, install=True)
        _patch_users += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_users -= 1
            while not _patch_users and _saved:
                owner, name, previous = _saved.pop()
                _script_as_original(getattr(owner, name), install=False)
                if previous is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, previous)


def _script_as_original(wrapper: Any, install: bool) -> None:
    """Let ``torch.jit.script`` compile a call of the wrapper as the op it wraps.

    TorchScript finds ``torch.tensor`` & co. in a table keyed by the function's ``id``; a
    wrapper has its own, and scripting would try to compile the wrapper's Python instead. The
    table is private, so without it only scripting inside a trace fails, as before.
    """
    with contextlib.suppress(Exception):
        from torch.jit import _builtins

        if not install:
            _builtins._get_builtin_table().pop(id(wrapper), None)  # the id may be reused later
            return
        op = _builtins._find_builtin(wrapper.__wrapped__)
        if op is not None:
            _builtins._register_builtin(wrapper, op)


_saved: list[tuple[Any, str, Any]] = []  # (owner, name, its own attribute or _MISSING)
_MISSING = object()


__all__ = ["Sync", "Trace", "Transfer", "TransferKind", "trace"]
