"""The Python entry points ``gk.trace()`` wraps while a trace is active, in any thread.

Some never reach the dispatcher, or reach it as many inner ops: ``Tensor.item/tolist/numpy/
__bool__/__float__/__int__/__index__/__repr__/__str__/__format__`` (one read each, however many
ops it runs inside; ``__index__`` only of a device tensor), ``torch.tensor/as_tensor/asarray``
and ``Tensor.new_tensor`` (a list copied to a device), ``torch.cuda.synchronize``,
``torch.accelerator.synchronize`` and ``torch.cuda.Stream/Event.synchronize``. :func:`patched`
wraps them, and puts back exactly what was there once the last trace ends; a wrapper records
into the recorder of its own thread (:data:`~.records.state`), so a thread without a trace only
pays one attribute read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpukit.diagnostics.trace.records import HOST, pinned, state


def _entry(
    original: Callable[..., Any], op: str, device_of: Callable[..., Any], host_work: bool = False
) -> Any:
    """``original``, recorded as one ``op`` sync; what it does inside is not recorded.
    ``host_work``: see :meth:`~.records.Recorder.record_sync`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        here = state
        if here.recorder is None or here.busy:
            return original(*args, **kwargs)
        here.busy = True
        try:
            out = original(*args, **kwargs)
        finally:
            here.busy = False
        recorder = here.recorder  # again: the call may have ended the trace
        if recorder is not None:
            recorder.record_sync(op, device_of(*args, **kwargs), host_work=host_work)
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
        busy, state.busy = state.busy, True
        try:
            out = original(*args, **kwargs)
        finally:
            state.busy = busy
        recorder = state.recorder
        if recorder is not None and not busy:
            data = args[data_at] if len(args) > data_at else kwargs.get("data", kwargs.get("obj"))
            src = data.device if isinstance(data, torch.Tensor) else torch.device(HOST)
            page_locked = isinstance(data, torch.Tensor) and pinned(data)
            recorder.record_transfer(src, out.device, out.nbytes, page_locked, True)
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


def _device(t: torch.Tensor, *_: Any, **__: Any) -> torch.device:
    return t.device


_TENSOR_ENTRIES = {"item": "item", "tolist": "tolist", "numpy": "numpy", "__bool__": "bool"}
_TENSOR_ENTRIES.update({"__float__": "float", "__int__": "int"})
_TENSOR_ENTRIES.update(dict.fromkeys(("__repr__", "__str__", "__format__"), "print"))


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, wrapper) for every entry point wrapped during a trace."""
    found: list[tuple[Any, str, Any]] = [
        (torch.Tensor, name, _entry(getattr(torch.Tensor, name), op, _device))
        for name, op in _TENSOR_ENTRIES.items()
    ]
    # A tensor used as a Python index (numpy or list indexing, slice bounds, range()): numpy
    # reads it in its own code, nanoGPT's batches index a memmap with torch.randint's offsets.
    # Reading a CPU tensor there is host work on any run, so only a device tensor counts.
    index = _entry(torch.Tensor.__index__, "index", _device, host_work=True)
    found.append((torch.Tensor, "__index__", index))
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
_saved: list[tuple[Any, str, Any]] = []  # (owner, name, its own attribute or _MISSING)
_MISSING = object()


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Wrap the entry points while the block runs, then put back exactly what was there: the
    owner's own attribute, or none where it was inherited (``Tensor.item`` lives on
    ``TensorBase``). Blocks in several threads share one set of wrappers.

    >>> import torch
    >>> with patched():
    ...     hasattr(torch.Tensor.item, "__wrapped__")
    True
    >>> hasattr(torch.Tensor.item, "__wrapped__")
    False
    """
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
