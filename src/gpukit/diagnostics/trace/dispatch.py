"""The dispatch mode of ``gk.trace()``: counts every aten op per device, and hands the few that
copy across devices or read data back to the host to the :class:`~.records.Recorder`, and every
op to the recorder's listeners (a placement log entered inside the trace: one dispatch pass
serves both).

It runs for every op, so the common path is one device lookup and two dict lookups: no frame
walk, no strings, no Python-level wrapper around the op or the mode. Only the watched ops
(:data:`WATCHED`) cost more.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from gpukit.diagnostics.trace.records import Recorder, pinned, state

# A process forked while a trace is active (a DataLoader worker) inherits the mode; it must
# only pass ops through there: its records would be lost, and cost every op.
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

Handler = Callable[[Recorder, tuple[Any, ...], dict[str, Any], Any], None]


def _dynamo_skipper() -> Callable[[Any], None] | None:
    """What tells torch.compile never to compile a function's frame nor any frame it calls,
    at no cost per call; None on a torch without it."""
    with contextlib.suppress(Exception):  # torch-private (2.6 and later); absent: see below
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameAction.SKIP
        strategy = eval_frame._FrameExecStrategy(skip, skip)
        return lambda code: eval_frame.set_code_exec_strategy(code, strategy)
    return None


_skip_dynamo = _dynamo_skipper()


class TraceMode(TorchDispatchMode):
    """Counts every op per device in ``recorder`` (and in the recorders of traces entered
    inside it); hands the watched copy and read-back ops to their handlers."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Torch keeps torch.compile out of __torch_dispatch__ by wrapping it in two Python
        # layers, about 1 us of the mode's 6 us per op; marking its code skipped (below) does
        # the same for free. Where that is not possible, torch's wrapping stays.
        return _skip_dynamo is None

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.ops = recorder.ops
        self.inner = recorder.inner  # the list itself: nested traces join and leave it
        self.listeners = recorder.listeners  # the same: placement logs join and leave it
        self.pid = _pid[0]
        # id(op) -> (op, what to call, its handler or None): one dict lookup per op instead of
        # OpOverload's Python-level __hash__ and __call__. Holding the op keeps its id unique.
        self.seen: dict[int, tuple[Any, Callable[..., Any], Handler | None]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        seen = self.seen.get(id(func))
        if seen is None:
            seen = self.seen[id(func)] = (func, _direct(func), WATCHED.get(func))
        listeners = self.listeners
        if not listeners:
            out = seen[1](*args, **kwargs) if kwargs else seen[1](*args)
        else:
            try:
                out = seen[1](*args, **kwargs) if kwargs else seen[1](*args)
            except BaseException:
                if self.pid == _pid[0]:
                    for listen in listeners:  # the op that failed, with its inputs
                        listen(func, args, kwargs or {}, None)
                raise
        if self.pid != _pid[0]:
            return out  # a forked child (see _pid)
        first = args[0] if args else out
        if not isinstance(first, torch.Tensor):
            first = _first_tensor(args, out)
        if first is not None:
            device = first.device
            self.ops[device] += 1
            for inner in self.inner:
                inner.ops[device] += 1
        if seen[2] is not None and not state.busy:
            seen[2](self.recorder, args, kwargs or {}, out)
        for listen in listeners:  # untraced() or not: a placement log sees every op
            listen(func, args, kwargs or {}, out)
        return out


if _skip_dynamo is not None:
    _skip_dynamo(TraceMode.__torch_dispatch__.__code__)


def _direct(func: Any) -> Callable[..., Any]:
    """The C++ callable a plain ``OpOverload`` calls; subclasses (TorchBind ops) keep their
    own ``__call__``."""
    return func._op if type(func) is OpOverload else func


def _first_tensor(args: tuple[Any, ...], out: Any) -> torch.Tensor | None:
    # One level deep, by the ops' schemas: no walker, this runs for every op.
    for value in (*args, out):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]  # foreach ops, cat, ops with several outputs
    return None


def _on_copy(src_at: int, dst_at: int | None) -> Handler:
    """Handles a copy op with its source and destination at these argument positions (None:
    the output); ``non_blocking`` is the third argument or a keyword."""

    def handle(rec: Recorder, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        src, dst = args[src_at], out if dst_at is None else args[dst_at]
        if isinstance(src, torch.Tensor) and src.device != dst.device:
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            page_locked = pinned(src) or pinned(dst) or bool(kwargs.get("pin_memory"))
            rec.record_transfer(src.device, dst.device, dst.nbytes, page_locked, blocking)

    return handle


def _on_read(op: str) -> Handler:
    def handle(rec: Recorder, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        indices = args[1] if op == "mask-index" and len(args) > 1 else None
        if isinstance(indices, (list, tuple)) and not any(_is_mask(i) for i in indices):
            return  # integer indices: the output's shape is known without the data
        if kwargs.get("output_size") is None:  # repeat_interleave with it knows its shape
            rec.record_sync(op, args[0].device)

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


def _watched_ops() -> dict[Any, Handler]:
    def op(spec: str) -> Any:  # getattr: some overloads are missing in older torch
        name, overload = spec.split(".")
        return getattr(getattr(torch.ops.aten, name, None), overload, None)

    found: dict[Any, Handler] = {op("_to_copy.default"): _on_copy(0, None)}
    found.update({op(s): _on_copy(1, 0) for s in ("copy_.default", "copy.default")})
    found.update(
        {op(s): _on_copy(0, 1) for s in ("_copy_from.default", "_copy_from_and_resize.default")}
    )
    for name, specs in _READS.items():
        found.update({op(s): _on_read(name) for s in specs.split()})
    found.pop(None, None)
    return found


WATCHED = _watched_ops()  # aten op -> its handler; every other op is only counted
