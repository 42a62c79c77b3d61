"""The four steps of single-process data parallelism: scatter, replicate, apply, gather.

Each works on CUDA devices and on a list of CPU "devices" alike, so the whole path runs in CI.
On CUDA, replicas come from ``torch.nn.parallel.replicate``: one coalesced broadcast of the
parameters whose backward is a coalesced reduce-add onto the first device. On the CPU every
replica already sits where the master weights are, so a replica shares them (a broadcast to the
same device is no copy) and only buffers are cloned, so that in-place updates such as
BatchNorm's running statistics never race between threads.

>>> import torch
>>> from torch import nn
>>> cpus = [torch.device("cpu")] * 2
>>> model = nn.Linear(3, 1)
>>> inputs = scatter((torch.ones(5, 3),), {}, [3, 2], cpus)
>>> outputs = parallel_apply(replicate(model, cpus), inputs, cpus)
>>> gather(outputs, torch.device("cpu")).shape
torch.Size([5, 1])
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit._util.batch import split
from gpukit._util.tree import map_tensors, zip_map

_Inputs = tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs) of one replica


def scatter(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sizes: Sequence[int],
    devices: Sequence[torch.device],
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """(args, kwargs) for each device: batch tensors cut to ``sizes`` and moved there."""
    chunks = split((args, kwargs), sizes)
    return [
        map_tensors(chunk, functools.partial(_move, device))
        for chunk, device in zip(chunks, devices, strict=False)
    ]


def _move(device: torch.device, tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(device, non_blocking=True)


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One replica of ``module`` per device; gradients of every replica reach ``module``."""
    if devices[0].type == "cuda":
        detach = not torch.is_grad_enabled()
        return list(torch.nn.parallel.replicate(module, list(devices), detach=detach))
    return [module] + [_host_replica(module) for _ in devices[1:]]


def _host_replica(module: nn.Module) -> nn.Module:
    """A shallow copy of the module tree that shares parameters and owns copies of buffers."""
    copies: dict[int, nn.Module] = {}
    for m in module.modules():
        replica = m.__new__(type(m))
        replica.__dict__ = m.__dict__.copy()
        replica._parameters = dict(m._parameters)
        replica._buffers = {k: None if b is None else b.clone() for k, b in m._buffers.items()}
        copies[id(m)] = replica
    for m in module.modules():
        # Children point at their own replicas; a module shared twice stays shared.
        copies[id(m)]._modules = {
            name: None if child is None else copies[id(child)] for name, child in m._modules.items()
        }
    return copies[id(module)]


@dataclass(frozen=True)
class _State:
    """What a worker thread must inherit from its caller: grad mode, autocast, and on CUDA the
    caller's current stream of each device (where the inputs and replicas were queued)."""

    grad: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    streams: dict[int, Any]

    @staticmethod
    def capture(devices: Sequence[torch.device]) -> _State:
        kinds = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        gpus = {d.index for d in devices if d.type == "cuda" and d.index is not None}
        return _State(
            torch.is_grad_enabled(),
            tuple((k, _autocast_enabled(k), _autocast_dtype(k)) for k in kinds),
            {i: torch.cuda.current_stream(i) for i in gpus},
        )

    def run(self, device: torch.device, fn: Callable[..., Any], inputs: _Inputs) -> Any:
        args, kwargs = inputs
        with torch.set_grad_enabled(self.grad), _cuda_scope(device, self.streams):
            managers = [torch.autocast(k, dtype=d, enabled=on) for k, on, d in self.autocast]
            for manager in managers:
                manager.__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                for manager in reversed(managers):
                    manager.__exit__(None, None, None)


def parallel_apply(
    fns: Sequence[Callable[..., Any]],
    inputs: Sequence[_Inputs],
    devices: Sequence[torch.device],
) -> list[Any]:
    """``fns[i](*args_i, **kwargs_i)`` on ``devices[i]``, one thread each; results in order.

    An exception in a worker is raised here, of the same type, naming the replica and device.
    """
    state = _State.capture(devices)
    pool = _pool(len(fns) - 1)
    futures = [
        pool.submit(_run_named, i, devices[i], state, fns[i], inputs[i]) for i in range(1, len(fns))
    ]
    # The first replica runs in this thread: one thread fewer to wake, and nothing to wait for
    # with a single device.
    try:
        first = _run_named(0, devices[0], state, fns[0], inputs[0])
    finally:
        done = [_outcome(f) for f in futures]  # every worker finishes before anything is raised
    for error in (e for _, e in done if e is not None):
        raise error
    return [first, *(r for r, _ in done)]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """Worker threads kept between calls: starting threads costs more than a small forward."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:  # grow by replacing
            old, _POOL = _POOL, ThreadPoolExecutor(max(workers, 1), thread_name_prefix="gpukit-dp")
            if old is not None:
                old.shutdown(wait=False)
        return _POOL


def _outcome(future: Future[Any]) -> tuple[Any, BaseException | None]:
    try:
        return future.result(), None
    except BaseException as err:
        return None, err


def gather(outputs: Sequence[Any], target: torch.device) -> Any:
    """The replicas' outputs joined on ``target``: tensors concatenated along dimension 0
    (0-d ones stacked), containers rebuilt, other values taken from the first replica."""

    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        moved = [t.to(target) for t in tensors]
        return torch.stack(moved) if moved[0].dim() == 0 else torch.cat(moved)

    return zip_map(outputs, join)


def _run_named(
    i: int, device: torch.device, state: _State, fn: Callable[..., Any], inputs: _Inputs
) -> Any:
    """Run replica ``i``; its error gets the replica and device in front of its message.
    The user's arguments stay packed, so none of them can clash with these parameters."""
    try:
        return state.run(device, fn, inputs)
    except Exception as err:
        renamed = _with_place(err, i, device)
        if renamed is err:
            raise
        raise renamed from err


def _with_place(err: BaseException, i: int, device: torch.device) -> BaseException:
    """The same kind of error with "replica i on device" in front of its message, so code that
    catches the type (out of memory, say) still does; a type that cannot be rebuilt from a
    message gets a note instead."""
    place = f"replica {i} on {device}"
    renamed: BaseException | None = None
    with contextlib.suppress(Exception):  # a constructor that wants more than a message
        renamed = type(err)(f"{place}: {err}")
    if renamed is not None and place in str(renamed):
        return renamed
    if hasattr(err, "add_note"):
        err.add_note(f"(raised in {place})")
    return err


def _cuda_scope(device: torch.device, streams: dict[int, Any]) -> Any:
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    scope = contextlib.ExitStack()
    scope.enter_context(torch.cuda.device(device))
    if device.index in streams:
        scope.enter_context(torch.cuda.stream(streams[device.index]))
    return scope


def _autocast_enabled(kind: str) -> bool:
    try:
        return bool(torch.is_autocast_enabled(kind))
    except TypeError:  # torch < 2.4 took no device type
        return bool(
            torch.is_autocast_cpu_enabled() if kind == "cpu" else torch.is_autocast_enabled()
        )


def _autocast_dtype(kind: str) -> torch.dtype:
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(kind)
    return torch.get_autocast_cpu_dtype() if kind == "cpu" else torch.get_autocast_gpu_dtype()
