"""The bytes of live tensors on each device, and their peak, counted op by op.

CUDA's caching allocator counts what tensors hold (``torch.cuda.max_memory_allocated``); a
CPU has no such counter (the process's resident memory also holds Python, libraries and freed
pages), so on a CPU gpukit counts tensor storages itself: :class:`LiveTensors` is a dispatch
mode that sees every op's outputs, follows each storage until it is freed (a weak reference)
or resized (FSDP frees and regathers parameters that way), and keeps each device's running
total and peak. The same counter runs over fake tensors in the planner's simulation, so a
prediction and a measurement are the same quantity, counted the same way.

Each storage is filed under what it is: the model's ``parameters`` and ``buffers``,
``gradients``, ``optimizer_state``, ``communication`` (collective buffers: DDP's buckets,
FSDP's gathered parameters and reduce-scatter outputs), ``activations`` (made outside backward
and the optimizer: forward outputs, the batch) and ``temporaries`` (made in backward or in the
optimizer's step and never kept). The peak's breakdown is the per-category totals at the moment
the total peaked.

Cost: one Python call per op while it is active, no host read, no copy, no synchronisation;
``gpukit train`` keeps it on only for the first optimizer steps (the steady state's peak is
reached by the second step, once the optimizer's state exists).

>>> import torch
>>> with LiveTensors() as live:
...     a = torch.ones(1024)          # 4 KiB
...     b = a * 2                     # 8 KiB live
...     del a, b
...     c = torch.ones(256)           # 1 KiB
>>> live.peak["cpu"], live.current["cpu"]
(8192, 1024)
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from gpukit._util.tree import tensors

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "communication",
    "activations",
    "temporaries",
)

# Collectives whose first argument (or argument list) is written by the communication:
# their outputs are communication buffers, whatever made them.
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass
    (DTensor: its local shard)."""
    stack = [t]
    while stack:
        obj = stack.pop()
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            stack.extend(v for v in (getattr(obj, n) for n in names) if isinstance(v, torch.Tensor))
        else:
            yield obj.untyped_storage()


class _Entry:
    """What the counter knows of one storage: its device, bytes and category."""

    __slots__ = ("category", "device", "nbytes", "ref")

    def __init__(self, device: str, nbytes: int, category: str) -> None:
        self.device, self.nbytes, self.category = device, nbytes, category
        self.ref: weakref.ref[torch.UntypedStorage] | None = None


class LiveTensors(TorchDispatchMode):
    """Count the bytes of live tensor storages per device while active (see the module doc).

    ``granularity`` rounds each storage up, as an allocator does (CUDA's caching allocator
    hands out multiples of 512 bytes); 1 counts exact bytes. :meth:`watch` files a model's
    and optimizers' tensors (existing ones too) under their categories.
    """

    def __init__(self, granularity: int = 1) -> None:
        super().__init__()
        self.granularity = granularity
        self.current: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.by_category: dict[str, dict[str, int]] = {}
        self.peak_breakdown: dict[str, dict[str, int]] = {}
        self._entries: dict[int, _Entry] = {}
        self._in_optimizer = 0
        self._hooks: list[Any] = []
        self._original_resize: Any = None
        # Storages freed since the last change, applied by the thread that counts: the last
        # reference may go on another thread (gloo drops a finished collective's buffers on
        # its own) or inside a garbage collection in the middle of a change.
        self._pending: collections.deque[tuple[int, _Entry]] = collections.deque()

    # -- what is being counted -------------------------------------------------------------
    def watch(self, module: nn.Module | None = None, optimizers: Iterable[Any] = ()) -> None:
        """File ``module``'s parameters, buffers and gradients and each optimizer's state under
        their categories, counting them if they are not counted yet (they existed before)."""
        if module is not None:
            for p in module.parameters():
                self.file(p, "parameters")
                if p.grad is not None:
                    self.file(p.grad, "gradients")
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_done))
            for b in module.buffers():
                self.file(b, "buffers")
        for optimizer in optimizers:
            self._file_optimizer(optimizer)

    def file(self, tensor: torch.Tensor, category: str) -> None:
        """Count ``tensor``'s storages (if new) under ``category``; move them there if counted."""
        for st in storages(tensor):
            entry = self._entries.get(id(st))
            if entry is None or entry.ref is None or entry.ref() is not st:
                self._add(st, tensor.device, category)
            elif entry.category != category:
                self._move(entry, category)

    def file_made(self, category: str) -> None:
        """Move what was made since the counting began, outside backward and the optimizer,
        to ``category``: what a setup made beside the model (DDP's buckets) is communication,
        not a batch's activations."""
        for entry in list(self._entries.values()):
            if entry.category == "activations":
                self._move(entry, category)

    # -- the mode ----------------------------------------------------------------------------
    def __enter__(self) -> LiveTensors:
        self._hooks += [
            register_optimizer_step_pre_hook(self._optimizer_starts),
            register_optimizer_step_post_hook(self._optimizer_ends),
        ]
        self._original_resize = torch.UntypedStorage.resize_
        original = self._original_resize

        def resize_(st: Any, size: int) -> Any:
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._drain()
        torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # A DTensor op runs whole (its outputs' local shards are counted below): the ops it
        # lowers to reach this mode only while its sharding is not cached yet, so following
        # them would count a step differently the first time it runs.
        out = func(*args, **(kwargs or {}))
        if func.namespace in _COLLECTIVE_NAMESPACES:
            for t in tensors((args, out)):
                self.file(t, "communication")
        # A view shares its base's storage: counted if the base was; a storage first seen
        # through a view (a dataset indexed by the loader) existed before counting.
        elif not getattr(func, "is_view", False):
            category = self._phase()
            if isinstance(out, torch.Tensor):  # most ops: one tensor, no walk
                self._new(out, category)
            else:
                for t in tensors(out):
                    self._new(t, category)
        return out

    # -- bookkeeping ---------------------------------------------------------------------------
    def _phase(self) -> str:
        if self._in_optimizer:
            return "temporaries"  # what the step keeps is re-filed as optimizer state after it
        if torch._C._current_graph_task_id() != -1:
            return (
                "temporaries"  # in backward: gradients of activations (a parameter's is re-filed)
            )
        return "activations"

    def _new(self, t: torch.Tensor, category: str) -> None:
        for st in storages(t):
            entry = self._entries.get(id(st))
            if entry is None or entry.ref is None or entry.ref() is not st:
                self._add(st, t.device, category)

    def _add(self, st: torch.UntypedStorage, device: torch.device, category: str) -> None:
        nbytes = self._rounded(st.nbytes())
        entry = _Entry(_device_name(device), nbytes, category)
        key = id(st)
        entry.ref = weakref.ref(st, functools.partial(self._on_collected, key, entry))
        self._entries[key] = entry
        self._change(entry, nbytes)

    def _on_collected(self, key: int, entry: _Entry, _ref: object) -> None:
        self._pending.append((key, entry))  # one atomic step, safe from any thread

    def _drain(self) -> None:
        while self._pending:
            self._freed(*self._pending.popleft())

    def _freed(self, key: int, entry: _Entry) -> None:
        if self._entries.get(key) is entry:
            del self._entries[key]
        self._change(entry, -entry.nbytes)

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._entries.get(id(st))
        if entry is None or entry.ref is None or entry.ref() is not st:
            if st.nbytes():
                self._add(st, st.device, "communication")
            return
        new = self._rounded(st.nbytes())
        grown = new - entry.nbytes
        if grown > 0 and entry.category not in ("parameters", "communication"):
            self._move(entry, "communication")
        entry.nbytes = new
        self._change(entry, grown)

    def _move(self, entry: _Entry, category: str) -> None:
        self._change(entry, -entry.nbytes, update_peak=False)
        entry.category = category
        self._change(entry, entry.nbytes, update_peak=False)

    def _change(self, entry: _Entry, delta: int, update_peak: bool = True) -> None:
        if delta > 0:
            self._drain()  # what was freed before this tensor was made
        device = entry.device
        total = self.current.get(device, 0) + delta
        self.current[device] = total
        counts = self.by_category.setdefault(device, dict.fromkeys(CATEGORIES, 0))
        counts[entry.category] += delta
        if update_peak and total > self.peak.get(device, 0):
            self.peak[device] = total
            self.peak_breakdown[device] = dict(counts)

    def _rounded(self, nbytes: int) -> int:
        g = self.granularity
        return -(-nbytes // g) * g

    def _grad_done(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.file(param.grad, "gradients")

    def _optimizer_starts(self, optimizer: Any, *_: Any) -> None:
        self._in_optimizer += 1

    def _optimizer_ends(self, optimizer: Any, *_: Any) -> None:
        self._in_optimizer -= 1
        self._file_optimizer(optimizer)

    def _file_optimizer(self, optimizer: Any) -> None:
        for state in optimizer.state.values():
            for t in tensors(state):
                self.file(t, "optimizer_state")
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.file(p.grad, "gradients")


def _device_name(device: torch.device) -> str:
    return str(device) if device.index is not None or device.type == "cpu" else f"{device.type}:0"
