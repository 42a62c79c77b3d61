"""Where every op runs: TensorFlow's ``log_device_placement`` for PyTorch.

Inside ``with log_placement() as log:`` every aten op of this thread is recorded as autograd
dispatches it, forward and backward alike, with the device, shape and dtype of each tensor it
reads and writes and the innermost module running. ``log.summary()`` then names what usually
hurts: ops on the CPU while the model is on an accelerator, cross-device copies, mixed inputs.

>>> import sys, torch
>>> from gpukit.diagnostics.oplog import log_placement
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
>>> x = torch.ones(3, 4)
>>> with log_placement(sys.stdout, model=model) as log:
...     out = model(x)
aten::t  cpu <- cpu[2,4]f32 -> cpu[4,2]f32  (0)
aten::addmm  cpu <- cpu[2]f32, cpu[3,4]f32, cpu[4,2]f32 -> cpu[3,2]f32  (0)
>>> log.summary().to_dict()["ops"]
{'cpu': 2}

Backward ops run after every module's forward has returned, so they are attributed to
``"(backward)"`` rather than to a module; ops outside any module call to ``"(no module)"``.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal, TextIO

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

from gpukit._util.files import write_error
from gpukit._util.text import described
from gpukit.diagnostics.op_records import (
    FactKey,
    OpRecord,
    Placement,
    TensorSpec,
    fact,
    joined,
    signature,
    specs,
)
from gpukit.diagnostics.oplog_summary import ModuleStats, PlacementSummary, device_counts
from gpukit.diagnostics.trace.records import Recorder
from gpukit.diagnostics.trace.records import state as trace_state
from gpukit.errors import ConfigError

Level = Literal["op", "module"]
LEVELS: tuple[Level, ...] = ("op", "module")
BACKWARD, NO_MODULE, ROOT = "(backward)", "(no module)", "(model)"
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
_new = tuple.__new__  # NamedTuple without its Python-level __new__: the per-op path stays lean
_pid = [os.getpid()]  # this process's id, kept current in forked children (see _Mode)
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


class _Frame:
    """One module forward call in progress."""

    __slots__ = ("inputs", "key", "name", "ops", "stats")

    def __init__(
        self, key: int, name: str, stats: ModuleStats | None, inputs: tuple[TensorSpec, ...]
    ) -> None:
        self.key, self.name, self.stats, self.inputs = key, name, stats, inputs
        self.ops: dict[str, int] = {}


class PlacementLog:
    """The context manager :func:`log_placement` returns; holds ``records`` or ``modules``."""

    def __init__(
        self, file: str | os.PathLike[str] | TextIO | None, level: Level, model: nn.Module | None
    ) -> None:
        self.level = level
        self.records: list[OpRecord] = []  # level="op"
        self.modules: dict[str, ModuleStats] = {}  # level="module", in order of first call
        self._file, self._model = file, model
        self._counts: Counter[FactKey] = Counter()  # level="module": what summary() needs
        self._bytes: Counter[FactKey] = Counter()
        self._params: Counter[str] = Counter()  # parameter elements per device, modules that ran
        self._seen: set[int] = set()
        self._names: dict[int, str] = {}
        self._op_names: dict[int, tuple[Any, str]] = {}  # id(op) -> (op, its name)
        self._facts: dict[tuple[int, str, Placement, Placement], tuple[FactKey, bool]] = {}
        self._listener = self._on_module_op if level == "module" else self._on_op
        self._stack: list[_Frame] = []
        self._thread = 0
        self._pid = 0
        self._handles: list[Any] = []
        self._mode: _Mode | None = None
        self._joined: Recorder | None = None  # the trace whose dispatch mode this log rides on
        self._out: TextIO | None = None
        self._owns_out = False

    def __enter__(self) -> PlacementLog:
        if self._mode is not None or self._joined is not None:
            raise ConfigError("this log_placement() is already active: use a new one to nest")
        if isinstance(self._file, (str, os.PathLike)):
            try:
                self._out, self._owns_out = open(self._file, "w", encoding="utf-8"), True
            except OSError as err:
                raise ConfigError(
                    f"log_placement(file={os.fspath(self._file)!r}) cannot be written ({err}); "
                    "pass a writable path, a text stream such as sys.stderr, or None"
                ) from err
        elif self._file is not None:
            self._out = self._file
        self._thread = threading.get_ident()
        self._pid = os.getpid()
        if self._model is not None:
            self._names = {id(m): name or ROOT for name, m in self._model.named_modules()}
        try:
            self._handles.append(register_module_forward_pre_hook(self._pre))
            # always_call: a forward that raises still pops its module off the stack.
            self._handles.append(register_module_forward_hook(self._post, always_call=True))
            recorder = trace_state.recorder
            if recorder is not None:  # inside gk.trace(): one dispatch pass serves both
                self._joined = recorder
                recorder.listeners.append(self._listener)
            else:
                self._mode = _Mode(self)
                self._mode.__enter__()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        self._mode = None
        if self._joined is not None:
            self._joined.listeners.remove(self._listener)
            self._joined = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        out, owned = self._out, self._owns_out
        self._out, self._owns_out = None, False
        if out is not None:
            with self._written():
                if owned:
                    out.close()
                else:
                    out.flush()

    def _write(self, text: str) -> None:
        assert self._out is not None
        with self._written():
            self._out.write(text)

    @contextlib.contextmanager
    def _written(self) -> Iterator[None]:
        """A log file the disk refuses (full, too large) mid-run is one clear error naming
        it; a stream the caller gave raises its own errors."""
        if not isinstance(self._file, (str, os.PathLike)):
            yield
            return
        try:
            yield
        except OSError as err:
            kept = "the lines written before it stay"
            raise write_error(self._file, err, kept=kept, option="log_placement(file=)") from err

    @property
    def model_device(self) -> str | None:
        """The non-CPU device holding most parameter elements of the modules that ran (or of
        ``model=`` if none ran); ``"cpu"`` when all are there; ``None`` without parameters."""
        params = self._params
        if not params and self._model is not None:
            params = Counter()
            for p in self._model.parameters():
                params[str(p.device)] += p.numel()
        off_cpu = {d: n for d, n in params.items() if d != "cpu"}
        return max(off_cpu, key=off_cpu.__getitem__) if off_cpu else ("cpu" if params else None)

    def summary(self) -> PlacementSummary:
        """Counts by device, and the ops worth a look; see :class:`PlacementSummary`."""
        counts, sizes = self._counts, self._bytes
        if self.level == "op":
            counts, sizes = Counter(), Counter()
            for r in self.records:
                key, nbytes = fact(r.op, r.inputs, r.outputs, r.module)
                counts[key] += 1
                sizes[key] += nbytes
        ops: Counter[str] = Counter()
        cpu: Counter[tuple[str, str]] = Counter()
        copies: Counter[tuple[str, str, str]] = Counter()
        copied: Counter[tuple[str, str, str]] = Counter()
        mixed: Counter[tuple[str, str, tuple[str, ...]]] = Counter()
        accel = self.model_device not in (None, "cpu")
        for key, n in counts.items():
            op, module, dev, copy, mix = key
            ops[dev] += n
            if copy is not None:
                copies[op, copy[0], copy[1]] += n
                copied[op, copy[0], copy[1]] += sizes[key]
            elif accel and dev == "cpu":
                cpu[op, module] += n
            if mix is not None:
                mixed[op, module, mix] += n
        return PlacementSummary(
            dict(sorted(ops.items())),
            self.model_device,
            [{"op": o, "module": m, "count": n} for (o, m), n in cpu.most_common()],
            [
                {"op": o, "src": s, "dst": d, "count": n, "bytes": copied[o, s, d]}
                for (o, s, d), n in copies.most_common()
            ],
            [
                {"op": o, "module": m, "devices": list(d), "count": n}
                for (o, m, d), n in mixed.most_common()
            ],
            list(self.modules.values()),
        )

    def _pre(self, module: nn.Module, args: Any) -> None:
        if threading.get_ident() != self._thread or self._pid != _pid[0]:
            return
        key = id(module)
        if key not in self._seen:  # parameters counted once: hooks run on every call
            self._seen.add(key)
            for p in module.parameters(recurse=False):
                self._params[str(p.device)] += p.numel()
        name = self._names.get(key) or type(module).__name__
        stats: ModuleStats | None = None
        inputs: tuple[TensorSpec, ...] = ()
        if self.level == "module":
            stats, inputs = self._stats(name, type(module).__name__), specs(args)
            stats.calls += 1
            stats.inputs.update(str(s.device) for s in inputs)
        self._stack.append(_Frame(key, name, stats, inputs))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self._thread or self._pid != _pid[0]:
            return
        key, stack = id(module), self._stack
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].key == key:
                break
        else:
            return  # its forward began before the log did
        frame = stack[i]
        del stack[i:]  # also drops inner frames a raising forward left behind
        if frame.stats is not None:
            outputs = specs(output)
            frame.stats.outputs.update(str(s.device) for s in outputs)
            if self._out is not None:
                label = (
                    frame.name
                    if frame.name == frame.stats.type
                    else (f"{frame.name} ({frame.stats.type})")
                )
                self._write(
                    f"{label}  {joined(frame.inputs)} -> {joined(outputs)}  "
                    f"ops: {device_counts(frame.ops) or '-'}\n"
                )

    def _stats(self, name: str, type_name: str) -> ModuleStats:
        stats = self.modules.get(name)
        if stats is None:
            stats = self.modules[name] = ModuleStats(name, type_name)
        return stats

    def _op_name(self, func: Any) -> str:
        # By id: OpOverload's __hash__ is Python code; holding the op keeps its id unique.
        known = self._op_names.get(id(func))
        if known is None:
            name = getattr(getattr(func, "_schema", None), "name", str(func))
            known = self._op_names[id(func)] = (func, name)
        return known[1]

    def _on_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        op = self._op_name(func)
        inputs = specs(args) + specs(tuple(kwargs.values())) if kwargs else specs(args)
        outputs = specs(out)
        if not inputs and not outputs:
            return  # no tensor in or out (the profiler's record_function marks): no placement
        frame, module = self._where()
        if self.level == "op":
            record: OpRecord = _new(OpRecord, (op, inputs, outputs, module))
            self.records.append(record)
            if self._out is not None:
                self._write(record.line() + "\n")
            return
        key, nbytes = fact(op, inputs, outputs, module)
        self._counts[key] += 1
        if nbytes:
            self._bytes[key] += nbytes
        dev = key[2]
        stats = frame.stats if frame is not None and frame.stats else self._stats(module, "")
        stats.ops[dev] = stats.ops.get(dev, 0) + 1
        if frame is not None:
            frame.ops[dev] = frame.ops.get(dev, 0) + 1

    def _where(self) -> tuple[Any, str]:
        """The innermost module frame running now (None outside one) and the name ops are
        counted under: the module's, BACKWARD while autograd runs a node, else NO_MODULE."""
        if _current_node() is not None:  # autograd is running a backward node
            return None, BACKWARD
        if self._stack:
            return self._stack[-1], self._stack[-1].name
        return None, NO_MODULE

    def _on_module_op(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """level="module", counted by signature: what fact() says of an op follows from the op,
        its module and where its tensors are, so it is worked out once per such combination
        (and for each copy, whose bytes it also counts); this runs for every op."""
        ins = signature(args)
        if kwargs and ins is not None:
            more = signature(tuple(kwargs.values()))
            ins = None if more is None else ins + more
        outs = signature(out)
        if ins is None or outs is None:  # data that only the walker reads
            self._on_op(func, args, kwargs, out)
            return
        if not ins and not outs:
            return  # no tensor in or out (the profiler's record_function marks)
        frame, module = self._where()
        sig = (id(func), module, ins, outs)
        known = self._facts.get(sig)
        if known is None or known[1]:
            inputs = specs(args) + specs(tuple(kwargs.values())) if kwargs else specs(args)
            key, nbytes = fact(self._op_name(func), inputs, specs(out), module)
            known = self._facts[sig] = (key, key[3] is not None)
            if nbytes:
                self._bytes[key] += nbytes
        key = known[0]
        self._counts[key] += 1
        dev = key[2]
        stats = frame.stats if frame is not None and frame.stats else self._stats(module, "")
        stats.ops[dev] = stats.ops.get(dev, 0) + 1
        if frame is not None:
            frame.ops[dev] = frame.ops.get(dev, 0) + 1


class _Mode(TorchDispatchMode):
    """Sees each aten op below autograd, so backward ops too; the log does the bookkeeping."""

    def __init__(self, log: PlacementLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.log._pid != _pid[0]:
            # A process forked inside the block (a DataLoader worker) inherits the mode; its
            # lines would interleave with ours in the same file.
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except BaseException:
            self.log._listener(func, args, kwargs, None)  # the op that failed, with its inputs
            raise
        self.log._listener(func, args, kwargs, out)
        return out


def log_placement(
    file: str | os.PathLike[str] | TextIO | None = None,
    level: Level = "op",
    *,
    model: nn.Module | None = None,
) -> PlacementLog:
    """Log the device of every op run inside the ``with`` block, in this thread.

    ``level="op"`` keeps one :class:`OpRecord` per op in ``log.records``; ``level="module"``
    keeps per-module :class:`ModuleStats` in ``log.modules`` and writes one line per module call.
    ``file``: None keeps the log in memory; a path or a text stream also gets each line as it
    happens. ``model=`` names modules by their path in it (``encoder.0``), else by class name.
    Ops of other threads (e.g. ``nn.DataParallel`` replicas) are not logged; the backward ops
    autograd runs for this thread are, on whichever thread it runs them.

    >>> import io, torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> lines = io.StringIO()
    >>> with log_placement(lines, level="module", model=model) as log:
    ...     out = model(torch.ones(3, 4))
    >>> print(lines.getvalue().strip())
    0 (Linear)  cpu[3,4]f32 -> cpu[3,3]f32  ops: cpu x2
    1 (Linear)  cpu[3,3]f32 -> cpu[3,2]f32  ops: cpu x2
    (model) (Sequential)  cpu[3,4]f32 -> cpu[3,2]f32  ops: -
    """
    if not isinstance(level, str) or level not in LEVELS:
        raise ConfigError(
            f"log_placement(level={described(level)}) is not a level: use 'op' (one record per op) "
            "or 'module' (one entry per module)"
        )
    if not (file is None or isinstance(file, (str, os.PathLike)) or _is_text_stream(file)):
        raise ConfigError(
            f"log_placement(file=...) got a {type(file).__name__}: pass None (memory only), "
            "a path (str or pathlib.Path), or a text stream such as sys.stderr"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(
            f"log_placement(model=...) got a {type(model).__name__}: pass the nn.Module whose "
            "submodules should be named by path, or leave it out"
        )
    return PlacementLog(file, level, model)


def _is_text_stream(file: object) -> bool:
    binary = isinstance(file, (io.RawIOBase, io.BufferedIOBase))
    return not binary and callable(getattr(file, "write", None))
