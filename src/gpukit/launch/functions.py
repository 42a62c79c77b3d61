"""``rt.launch``: a function run as the ranks of a job, under ``gpukit launch``'s supervisor.

Each rank is one of ``run_job``'s workers, so ``rt.launch`` watches what ``gpukit launch``
watches: heartbeats, a hang (no beat for ``hang_timeout`` seconds: the report names the stuck
rank and its line), the first failure named with its step, restarts (``max_restarts``, never
for a job that took no step nor in a crash loop), SIGTERM/SIGINT passed on for one coordinated save,
and workers that die with this process.

A rank is a fresh interpreter running the runner (``_launched_script.py --call FILE``). FILE, in
the job's folder, holds what multiprocessing's "spawn" gives its processes (this process's
``sys.path``, ``argv``, working folder, and its ``__main__`` to import again as
``__mp_main__``, so that a script's ``if __name__ == "__main__":`` block does not run again),
then ``run_rank`` with ``fn`` and its arguments, pickled (``fn`` by reference). A function a
fresh interpreter could not import (``python -c``, a notebook, a lambda: see
``start_methods.start_method``) runs in processes forked from this one instead, the same
workers under the same supervisor (each rank then computes on one CPU thread: OpenMP's threads
do not survive a fork).

What ``rt.launch`` returns or raises, as it always has: rank 0's return value (pickled by value
into the job's folder); the first failure's gpukit error again (``rank 1: ...``), or a
:class:`LaunchError` with its traceback; :class:`Preempted` when the ranks stopped on request;
``KeyboardInterrupt`` on a Ctrl-C that left nothing saved, or on a second Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing.process
import os
import pickle
import queue
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from gpukit import _env, errors
from gpukit._util.files import converted, write_atomic
from gpukit.errors import ConfigError, GpukitError, LaunchError, Preempted
from gpukit.launch import DEFAULT_HANG_TIMEOUT, INTERRUPTED_EXIT, RUNNER, _launched_script, run_job
from gpukit.launch.attempt_watch import Outcome
from gpukit.launch.failures import PREEMPTED_EXIT, RankEnd, failures, headline, rank_lines
from gpukit.launch.hang_reports import REPORT_FILE
from gpukit.launch.job_folders import fresh_job_dir, release, swept
from gpukit.launch.start_methods import start_method
from gpukit.launch.starters import CommandStarter, RankStarter
from gpukit.launch.supervisor import Attempt
from gpukit.launch.workers import Worker, die_with, watch_worker

NAME = "rt.launch"
CALL_FILE = "call.pkl"


def check_options(max_restarts: Any, hang_timeout: Any) -> None:
    """ConfigError for a ``max_restarts`` or ``hang_timeout`` that ``rt.launch`` cannot use.

    >>> check_options(2, None), check_options(0, 0.5)
    (None, None)
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(
            f"rt.launch(max_restarts={max_restarts!r}): give a whole number of restarts, 0 or "
            "more (0: a failure ends the job)"
        )
    number = isinstance(hang_timeout, (int, float)) and not isinstance(hang_timeout, bool)
    if hang_timeout is not None and not (
        number and math.isfinite(hang_timeout) and hang_timeout >= 0
    ):
        raise ConfigError(
            f"rt.launch(hang_timeout={hang_timeout!r}): give seconds without a heartbeat, 0 "
            f"or more (0: never treat a rank as hung; None: the default, {DEFAULT_HANG_TIMEOUT:g})"
        )


def launch_function(
    make_runtime: Callable[[], Any],
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    max_restarts: int = 0,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
) -> Any:
    """Run ``fn(make_runtime(), *args)`` as ``world_size`` ranks; rank 0's result.

    ``make_runtime`` (picklable: ``functools.partial(Runtime, ...)``, say) is called inside
    each rank, once the launch environment is in place, so it sees its rank."""
    check_options(max_restarts, hang_timeout)
    call = (make_runtime, fn, args)
    method = start_method(fn, call)
    for line in swept(NAME):
        print(line, file=sys.stderr, flush=True)
    folder = fresh_job_dir()
    ended: list[tuple[Attempt, Outcome]] = []
    try:
        if method == "spawn":
            path = folder / CALL_FILE
            with converted(path, option="TMPDIR=a writable folder"), path.open("wb") as file:
                pickle.dump(_preparation(), file)
                # Plain pickle: tensors among the arguments travel by value.
                pickle.dump(_Call(*call), file)
            ranks: RankStarter = CommandStarter([sys.executable, str(RUNNER), "--call", str(path)])
        else:
            ranks = ForkStarter(_Call(*call))
        # Each rank computes on as many threads as one process started by "spawn" would.
        threads = os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())
        code = run_job(
            ranks,
            world_size,
            max_restarts=max_restarts,
            hang_timeout=hang_timeout,
            env={"OMP_NUM_THREADS": threads},
            name=NAME,
            job_dir=folder,
            on_attempt=lambda attempt, outcome: ended.append((attempt, outcome)),
        )
        return _result(code, ended, folder)
    finally:
        release(folder)
        if not (folder / REPORT_FILE).exists():  # a hang's stack dumps stay: its report said so
            shutil.rmtree(folder, ignore_errors=True)


class _Call:
    """What each rank runs: ``fn(make_runtime(), *args)``; rank 0 writes what it returned to
    the job's folder."""

    def __init__(self, make_runtime: Callable[[], Any], fn: Callable[..., Any], args: Any):
        self.make_runtime, self.fn, self.args = make_runtime, fn, args

    def __call__(self) -> None:
        runtime = self.make_runtime()
        try:
            result = self.fn(runtime, *self.args)
        finally:
            runtime.teardown()
        folder = _env.job_dir()
        if runtime.is_global_zero and folder is not None:
            # Plain pickle copies tensors by value (torch's own pickling would share memory
            # with a process that is about to exit).
            write_atomic(folder / f"result-{_env.attempt()}.pkl", pickle.dumps(result))


def _preparation() -> dict[str, Any]:
    """What ``multiprocessing.spawn.prepare`` sets up in a new interpreter, as "spawn" sends
    it (without the start method or the authentication key, which no rank uses)."""
    origin = getattr(multiprocessing.process, "ORIGINAL_DIR", None) or os.getcwd()
    data: dict[str, Any] = {
        "sys_path": [origin if p == "" else p for p in sys.path],
        "sys_argv": sys.argv,
        "dir": os.getcwd(),
        "orig_dir": origin,
    }
    main = sys.modules["__main__"]
    name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if name is not None:
        data["init_main_from_name"] = name
    elif path is not None:
        data["init_main_from_path"] = os.path.normpath(os.path.join(origin, path))
    return data


class _Forked:
    """A rank forked from this process, leader of a process group of its own (its worker kills
    the group); ``returncode`` as ``subprocess.Popen`` has it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class ForkStarter(RankStarter):
    """Starts each rank as a fork of this process that calls ``call``: the one way to run a
    function that only this process holds."""

    def __init__(self, call: _Call) -> None:
        self.call = call

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def start(self, rank: int, env: Mapping[str, str], events: queue.SimpleQueue[int]) -> Worker:
        started, parent = time.time(), os.getpid()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child would print what is buffered here again
        pid = os.fork()
        if pid == 0:
            _forked_rank(self.call, env, parent)
        # Both sides set the group: killing it must work from the moment this returns.
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        return watch_worker(rank, _Forked(pid), started, events)


def _forked_rank(call: _Call, env: Mapping[str, str], parent: int) -> NoReturn:
    """The forked child: a rank like the runner's, then out without running this process's
    exit handlers (they belong to the parent)."""
    code = 1
    try:
        os.setpgid(0, 0)
        die_with(parent)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handlers are not ours
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        # OpenMP's worker threads (torch's intra-op pool on the CPU) do not survive a fork: a
        # child that enters a parallel region after the parent has used one waits for them
        # forever. One thread per rank never enters one.
        torch.set_num_threads(1)
        _launched_script.install_stack_dump()
        _launched_script.run(call)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _result(code: int, ended: list[tuple[Attempt, Outcome]], folder: Path) -> Any:
    """What ``run_job``'s exit ``code`` means for ``rt.launch``: rank 0's result, or the error
    to raise."""
    attempt, outcome = ended[-1]
    signals = attempt.signals
    if code == 0:
        result = folder / f"result-{attempt.number}.pkl"
        return pickle.loads(result.read_bytes()) if result.exists() else None
    if code == INTERRUPTED_EXIT or signals.forced:  # the user's second Ctrl-C
        raise KeyboardInterrupt
    if code == PREEMPTED_EXIT:
        if outcome.preempted_message:  # the ranks saved: where, and how to resume
            raise Preempted(outcome.preempted_message)
        if signals.received and signals.received[0] == signal.SIGINT:
            raise KeyboardInterrupt  # nothing saved: a Ctrl-C ends this process as usual
        received = signal.Signals(signals.received[0]).name if signals.received else "SIGTERM"
        raise Preempted(f"{received} received: the ranks stopped, unsaved")
    if outcome.status == "hung" and outcome.fault is not None:
        fault = outcome.fault
        report = folder / REPORT_FILE
        told = report.read_text().split("\n", 1)[-1].rstrip() if report.exists() else ""
        raise LaunchError(
            f"{fault.text}, at {fault.message}: no heartbeat for {attempt.settings.hang_timeout:g}"
            f" s (hang_timeout); the stack dumps are kept in {folder}\n{told}"
        )
    failed = failures(outcome.ends)
    if not failed:
        raise LaunchError(f"the ranks did not finish (exit {code})")
    # The first rank that failed of its own accord: its error is raised again here (a gpukit
    # error that says what went wrong, like rt.save called on one rank only, is the news even
    # when the headline blames the rank that diverged).
    own = [end for end in failed if end.failed and not end.consequence]
    raise _failure(own[0] if own else failed[0], outcome, attempt)


def _failure(first: RankEnd, outcome: Outcome, attempt: Attempt) -> GpukitError:
    """The error that tells why ``first``, the first rank to fail, failed."""
    lines = "\n".join([headline(outcome.ends, NAME), *rank_lines(outcome.ends)])
    error = first.error
    if not first.failed:  # it diverged from the others' collectives, then was stopped
        return LaunchError(f"rank {first.rank} failed:\n{lines}")
    if error is None or error.message.startswith("SystemExit"):
        return LaunchError(f"{_exit_message(first.rank, first.code)}\n{lines}")
    kind, _, message = error.message.partition(": ")
    cls = getattr(errors, kind, None)
    if isinstance(cls, type) and issubclass(cls, GpukitError):
        return cls(f"rank {first.rank}: {message}")  # its own message is the news
    return LaunchError(f"rank {first.rank} failed:\n{lines}\n\n{_traceback(attempt, first.rank)}")


def _traceback(attempt: Attempt, rank: int) -> str:
    """The traceback the runner recorded for ``rank``."""
    try:
        data = json.loads(attempt.error_file(rank).read_text())
        return str(data["message"]["extraInfo"]["py_callstack"]).rstrip()
    except (OSError, ValueError, KeyError, TypeError):
        return "(no traceback recorded)"


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
