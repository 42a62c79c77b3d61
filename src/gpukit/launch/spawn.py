"""Starting processes: ``rt.launch`` on this machine, ``gpukit launch`` through torchrun.

``spawn`` starts one process per rank with the environment torchrun would give them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port of
127.0.0.1). When a rank fails, the others are stopped and its error and traceback are raised
here as a :class:`LaunchError`: no rank is left waiting in a collective.

The processes are started with "spawn" (a fresh interpreter that imports ``fn`` by name) when
that can work. A function the new interpreter could not import (one defined in ``python -c``,
a notebook or the interactive prompt, whose ``__main__`` has no file; a lambda or a nested
function) is run in forked processes instead, where the platform can fork and CUDA has not been
initialised in this process (a forked child cannot use CUDA then), each rank then computing on
one CPU thread (OpenMP's threads do not survive a fork); otherwise a :class:`LaunchError` says
why and what to do.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from gpukit import _env, errors
from gpukit.errors import ConfigError, GpukitError, LaunchError, Preempted
from gpukit.lifecycle.preemption import SECOND_SIGNAL_AFTER_S

GRACE_S = 1.5  # after the first failure, for the other ranks to fail on their own
# How a rank ends when a signal stops it with nothing saved: by the signal itself, as torch's
# process wrapper ends on KeyboardInterrupt (0 is a rank that finished), killed at the grace
# period's end, or giving up itself then (143, without a record of a save).
_STOPPED = (-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGINT, -signal.SIGKILL, 143)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """Raise ConfigError when ``port`` on ``host`` is taken (a rendezvous would hang or fail)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"port {port} on {host} is already in use ({err.strerror}): pick another "
                "with --master-port, or leave it out to get a free one"
            ) from None


def spawn(
    make_runtime: Callable[[], Any],
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> Any:
    """Run ``fn(make_runtime(), *args)`` in ``world_size`` new processes; rank 0's result.

    ``make_runtime`` (picklable: ``functools.partial(Runtime, ...)``, say) is called inside
    each process, once the launch environment is in place, so it sees its rank. SIGTERM or
    SIGINT sent to this process while the ranks run is passed on to them (they save and stop:
    :class:`~gpukit.Preempted` is raised here); a failed rank's peers get a short grace to fail
    on their own and are then killed, never signalled to stop (that would ask them to save)."""
    method = start_method(fn, (make_runtime, fn, args))
    port = free_port()
    # Results and errors travel as files: a pipe would block a rank writing more than its
    # buffer holds while this process waits for the ranks to exit.
    with tempfile.TemporaryDirectory(prefix="gpukit-launch-") as folder:
        outbox = Path(folder)
        context = mp.start_processes(
            _worker,
            args=(make_runtime, world_size, port, fn, args, str(outbox), method == "fork"),
            nprocs=world_size,
            start_method=method,
            join=False,
        )
        with _PassedOn(context.processes) as signals:
            codes = _watch(context.processes, signals)
        if signals.kill_now:  # the user's second Ctrl-C: out at once, as Python would
            raise KeyboardInterrupt
        stopped = sorted(outbox.glob("preempted-*.txt"))
        if stopped:  # asked to stop: every rank saved and left together
            raise Preempted(stopped[0].read_text())
        failed = [(rank, code) for rank, code in codes if code != 0]
        result = outbox / "result.pkl"
        interrupted = not failed and not result.exists()  # torch's wrapper ate a Ctrl-C
        if signals.received and (interrupted or all(c in _STOPPED for _, c in failed)):
            # Ranks with nothing to save (no checkpoint folder, or stopped before their
            # first step) ended as the signal ends a process: so does this one.
            if signals.received[0] == "SIGINT":
                raise KeyboardInterrupt
            stop = Preempted(f"{signals.received[0]} received: the ranks stopped, unsaved")
            print(f"gpukit: {stop}", file=sys.stderr, flush=True)
            raise stop
        if failed:
            raise _failure(*failed[0], outbox, context.error_files)
        return pickle.loads(result.read_bytes()) if result.exists() else None


class _PassedOn:
    """While the ranks run: SIGTERM and SIGINT to this process are passed on to them (a
    terminal's Ctrl-C reaches them too; copies never count twice, see
    ``gpukit.lifecycle.preemption``). A SIGINT that comes ``SECOND_SIGNAL_AFTER_S`` or more after
    the first is the user's second Ctrl-C: the ranks are killed at once."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes
        self.received: list[str] = []
        self.kill_now = False
        self.deadline: float | None = None  # the ranks' time to save and exit, once signalled
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _PassedOn:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self.received.append(signal.Signals(signum).name)
            self.deadline = now + _env.stop_grace()
            for process in self.processes:
                if process.is_alive():
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, signum)
        elif signum == signal.SIGINT and now - self._first >= SECOND_SIGNAL_AFTER_S:
            self.kill_now = True


def _watch(processes: list[Any], signals: _PassedOn) -> list[tuple[int, int]]:
    """Wait for every rank; (rank, exit code) in the order they ended. After the first failure
    the others get ``GRACE_S`` to fail on their own (which dates their failure after it); a
    rank that stopped on request (143) leaves its peers the whole stop grace to save."""
    ended: list[tuple[int, int]] = []
    waiting = {p.sentinel: rank for rank, p in enumerate(processes)}
    kill_at: float | None = None
    while waiting:
        for sentinel in mp_connection.wait(list(waiting), timeout=0.2):
            rank = waiting.pop(sentinel)
            processes[rank].join()
            code = processes[rank].exitcode
            ended.append((rank, code))
            if code != 0 and kill_at is None:
                grace = _env.stop_grace() if code == Preempted.exit_code else GRACE_S
                kill_at = time.monotonic() + grace
        deadlines = [t for t in (kill_at, signals.deadline) if t is not None]
        late = bool(deadlines) and time.monotonic() >= min(deadlines)
        if waiting and (late or signals.kill_now):
            for rank in waiting.values():
                with contextlib.suppress(OSError):
                    processes[rank].kill()
    return ended


def _failure(rank: int, code: int, outbox: Path, error_files: list[str]) -> GpukitError:
    """The error that tells why rank ``rank`` ended with ``code``."""
    reported = outbox / f"error-{rank}.pkl"
    if reported.exists():  # a GpukitError: the rank's own one-line message is the news
        cls_name, message = pickle.loads(reported.read_bytes())
        cls = getattr(errors, cls_name, GpukitError)
        if isinstance(cls, type) and issubclass(cls, GpukitError):
            return cls(f"rank {rank}: {message}")
    traceback = Path(error_files[rank])
    if traceback.exists():  # torch's wrapper pickled the traceback of the rank's exception
        text = pickle.loads(traceback.read_bytes())
        return LaunchError(
            f"rank {rank} failed:\n\n-- Process {rank} terminated with the "
            f"following error:\n{text}".rstrip()
        )
    return LaunchError(_exit_message(rank, code))


def _exit_message(rank: int, code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = " (often the kernel's out-of-memory killer: see `dmesg`)" if name == "SIGKILL" else ""
        return f"rank {rank} was killed by {name} before finishing{why}"
    return (
        f"rank {rank} exited with code {code} before finishing, without a Python error from "
        "fn: its output above says why (sys.exit or os._exit in fn, or a failure before fn "
        "started)"
    )


def start_method(fn: Callable[..., Any], payload: Any) -> str:
    """How to start the processes that run ``fn``: "spawn" when a fresh interpreter can
    rebuild ``payload`` (what every process is sent: ``fn``, its arguments), else "fork" where
    that is safe; a LaunchError saying why and what to do when neither works.

    >>> import json
    >>> start_method(json.dumps, (json.dumps, ("x",)))
    'spawn'
    """
    why = _why_spawn_fails(payload)
    if why is None:
        return "spawn"
    name = _name(fn)
    short = name.rsplit(".", 1)[-1] if name.rsplit(".", 1)[-1].isidentifier() else "fn"
    problem = f"rt.launch({name}): {why}, so processes started with 'spawn' cannot rebuild it"
    fix = (
        f"define {short} at the top level of a .py file and import it from there (from "
        f"mymodule import {short}), or run a script with `gpukit launch --nproc N script.py`"
    )
    if "fork" not in mp.get_all_start_methods():
        raise LaunchError(f"{problem}, and this platform cannot fork: {fix}")
    if torch.cuda.is_initialized():
        raise LaunchError(
            f"{problem}, and CUDA is already initialised in this process, so forked processes "
            f"could not use it: call rt.launch before anything touches CUDA, or {fix}"
        )
    return "fork"


def _name(fn: Any) -> str:
    """The user's function inside the partials that carry it (gpukit wraps it in one)."""
    while isinstance(fn, functools.partial):
        inside = [f for f in (fn.func, *fn.args) if callable(f)]
        fn = next((f for f in inside if not _module(f).startswith("gpukit.")), fn.func)
    return str(getattr(fn, "__qualname__", None) or repr(fn))


def _module(obj: Any) -> str:
    return str(getattr(obj, "__module__", None) or "")


def _why_spawn_fails(payload: Any) -> str | None:
    """Why a fresh interpreter could not rebuild ``payload``, or None when it can."""
    main = sys.modules.get("__main__")
    fileless_main = getattr(main, "__file__", None) is None
    found: list[str] = []

    class _Finder(pickle.Pickler):
        # Functions and classes are pickled by name: note those that live in __main__.
        def reducer_override(self, obj: Any) -> Any:
            if getattr(obj, "__module__", None) == "__main__" and (
                isinstance(obj, type) or callable(obj)
            ):
                found.append(getattr(obj, "__qualname__", repr(obj)))
            return NotImplemented

    try:
        _Finder(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    except Exception as err:  # PicklingError, or AttributeError/TypeError for local objects
        what = str(err).splitlines()[0] if str(err) else ""
        return f"fn or its arguments cannot be pickled ({type(err).__name__}: {what})"
    if found and fileless_main:
        where = "python -c, a notebook or the interactive prompt"
        return f"{found[0]} is defined in __main__ of a program without a file ({where})"
    return None


class _Discard(io.RawIOBase):
    """A file that keeps nothing: the pickling above is a dry run."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(data)


def _worker(
    local_rank: int,
    make_runtime: Callable[[], Any],
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    outbox: str,
    forked: bool,
) -> None:
    if forked:
        # OpenMP's worker threads (torch's intra-op pool on the CPU) do not survive a fork: a
        # child that enters a parallel region after the parent has used one waits for them
        # forever. One thread per rank never enters one.
        torch.set_num_threads(1)
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        runtime = make_runtime()
        try:
            result = fn(runtime, *args)
        finally:
            runtime.teardown()
    except GpukitError as err:
        error = pickle.dumps((type(err).__name__, str(err)))
        (Path(outbox) / f"error-{local_rank}.pkl").write_bytes(error)
        raise
    except Preempted as stop:  # every rank saved at the same step: raised again in the parent
        (Path(outbox) / f"preempted-{local_rank}.txt").write_text(str(stop))
        raise
    if runtime.is_global_zero:
        # Plain pickle copies tensors by value (torch's own pickling would share memory with
        # a process that is about to exit).
        (Path(outbox) / "result.pkl").write_bytes(pickle.dumps(result))
