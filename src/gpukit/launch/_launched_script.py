"""Runs a user's script in each process of ``gpukit launch`` and records how it failed.

The launcher (gpukit's own on one machine, torchrun on several) runs this file, not the script,
in every process. The script still runs as ``python script.py`` would run it:
``__name__ == "__main__"``, ``sys.argv[0]`` is its path and its folder comes first on
``sys.path``; ``-m package.module`` runs a module as ``python -m`` would (the current folder
first on ``sys.path``). When it raises, the error goes to the per-process error file
(``TORCHELASTIC_ERROR_FILE``) with a nanosecond clock: whole seconds are too coarse to tell the
process that failed from the ones that failed a few milliseconds later because it had gone. The
traceback printed is the script's own, without this file's frames. An error with an integer
``exit_code`` attribute (gpukit's ``Preempted``: 143) ends the process with that code, after
one line saying what it was. Under gpukit's launcher, bad input (gpukit's ``ConfigError`` or
``DeviceError``) is recorded with the script's line and ends the process with code 2, silently:
the launcher prints it once for every rank that raised it, as one process would print it.

Before the script starts, ``SIGUSR1`` is set to write every thread's Python stack to
``GPUKIT_JOB_DIR/stack-<rank>-<attempt>.txt`` (when the launcher set ``GPUKIT_JOB_DIR``): the
launcher asks for it when a rank stops beating, to show where each rank was. When the script
ends without tearing down a gpukit Runtime it set up, the runner does it (the models first, then the
process group), before the interpreter's shutdown, where gloo's threads would abort the process.

This file is run by path, not imported as ``gpukit...``: importing the package would import
torch before the script has had a chance to set its environment. So it reads its few variables
itself, and must import nothing beyond the standard library.

    python _launched_script.py train.py --epochs 3
    python _launched_script.py -m gpukit train --workload mlp
    python _launched_script.py --call JOB_DIR/call.pkl   # rt.launch's function, by reference
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import json
import os
import runpy
import signal
import sys
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any

# The dump files stay open for the life of the process: faulthandler writes to their file
# descriptors from its signal handler.
_DUMP_FILES: list[IO[str]] = []


def install_stack_dump() -> str | None:
    """On ``SIGUSR1``, write every thread's stack to ``GPUKIT_JOB_DIR/stack-<rank>-<attempt>.txt``
    and carry on; the path, or None without ``GPUKIT_JOB_DIR`` (or ``SIGUSR1``, on Windows).

    A process that gpukit's launcher starts some other way (``gpukit train``'s own ranks) calls
    this before its work, so the launcher can show where it hangs.
    """
    folder = os.environ.get("GPUKIT_JOB_DIR", "").strip()
    usr1 = getattr(signal, "SIGUSR1", None)
    if not folder or usr1 is None:
        return None
    rank = os.environ.get("RANK", "0").strip() or "0"
    attempt = os.environ.get("GPUKIT_ATTEMPT", "0").strip() or "0"
    path = os.path.join(folder, f"stack-{rank}-{attempt}.txt")
    try:
        file = open(path, "w")  # noqa: SIM115 (kept open, see _DUMP_FILES)
    except OSError:
        return None  # no dump is a smaller loss than a run that cannot start
    faulthandler.register(usr1, file=file, all_threads=True)
    _DUMP_FILES.append(file)
    return path


def main() -> None:
    install_stack_dump()
    args = sys.argv[1:]
    script = None
    if args[:1] == ["--call"]:
        target: Callable[[], Any] = functools.partial(_call, args[1])
    elif args[:1] == ["-m"]:
        module, *rest = args[1:]
        sys.argv = [module, *rest]  # run_module puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        target = functools.partial(runpy.run_module, module, run_name="__main__", alter_sys=True)
    else:
        script, *rest = args
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        target = functools.partial(runpy.run_path, script, run_name="__main__")
    run(target, script)


def run(target: Callable[[], Any], script: str | None = None) -> None:
    """Call ``target``; when it raises, record the error and end the process (``SystemExit``)
    with 1, the error's own ``exit_code``, or 2 for bad input under gpukit's launcher."""
    try:
        namespace = target()  # holds the script's objects until its Runtimes are closed
        _close_runtimes()
        del namespace
    except SystemExit as stop:
        if stop.code in (None, 0):
            _close_runtimes()
        else:
            if not _recorded():  # gpukit train's own record stays
                record(stop)
            quick_exit()
        raise
    except Exception as err:  # KeyboardInterrupt and the like end the process as usual
        if is_bad_input(err) and report_bad_input(err, _raised_at(err, script)):
            quick_exit()
            sys.exit(2)
        record(err)
        code = getattr(err, "exit_code", None)
        if isinstance(code, int) and not isinstance(code, bool) and code != 0:
            # A deliberate stop (a preemption that saved): its message is the whole news.
            print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
            sys.exit(code)
        # The hook prints the traceback the error carries, so trim it there.
        tb = err.__traceback__
        tb = scripts_frames(tb, script) if script is not None else _past_runner(tb)
        err = err.with_traceback(tb)
        sys.excepthook(type(err), err, err.__traceback__)
        quick_exit()
        sys.exit(1)


def _close_runtimes() -> None:
    """Tear down the gpukit Runtimes the script left open, while the interpreter still runs
    (only if the script imported gpukit: this file imports nothing of it)."""
    runtime = sys.modules.get("gpukit.runtime.runtime")
    if runtime is not None:
        runtime.teardown_open_runtimes()


def _call(path: str) -> None:
    """``--call FILE`` (``rt.launch``): FILE holds what multiprocessing's "spawn" gives its
    processes (the parent's ``sys.path``, ``argv``, working folder, and its ``__main__`` to
    import again as ``__mp_main__``: the script's ``if __name__ == "__main__":`` block does not
    run again), then the function to call, pickled."""
    import multiprocessing.spawn
    import pickle

    with open(path, "rb") as file:
        multiprocessing.spawn.prepare(pickle.load(file))
        call = pickle.load(file)  # imports the function's module, gpukit and torch
    call()


def quick_exit() -> None:
    """A failed process is on its way out: let the interpreter's shutdown skip the collections
    over every object it holds (``gc.freeze``: seconds with torch loaded on a busy machine), so
    that its peers' launcher, which waits for it, restarts the job sooner. The shutdown runs as
    usual otherwise: threads joined, ``atexit`` handlers, modules and their objects released
    (objects alive at exit in reference cycles keep their finalizers unrun, which Python never
    promised to run)."""
    gc.freeze()


def record(err: BaseException, extra: dict[str, str] | None = None) -> None:
    """Write ``err`` to the error file, in torchrun's format plus ``time_ns`` (and ``extra``)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
                "time_ns": str(time.time_ns()),
                # gpukit's errors that a restart would meet again (bad input, a full disk)
                "will_repeat": getattr(err, "will_repeat", False) is True,
                **(extra or {}),
            },
        }
    }
    # Written aside and renamed: the launcher reads the whole record or none, never half of one.
    partial = f"{path}.tmp-{os.getpid()}"
    try:
        with open(partial, "w") as file:
            json.dump(data, file)
        os.replace(partial, path)
    except OSError:  # the script's own error matters more than our record of it
        with contextlib.suppress(OSError):
            os.remove(partial)


# gpukit's errors for input a user can fix (checked by name: this file imports no gpukit),
# and a checkpoint the disk refused: every rank raises the same agreed message, though only
# the writing ones failed, so it is said once by the launcher, as a command says it (exit 2:
# a restart would meet it again), never once per rank nor blaming a rank that writes nothing.
_BAD_INPUT = ("ConfigError", "DeviceError", "CheckpointWriteError")


def is_bad_input(err: BaseException) -> bool:
    """Whether ``err`` is gpukit's refusal of bad input (a ``ConfigError`` or ``DeviceError``),
    or a ``CheckpointWriteError`` (a disk that refused the checkpoint, said alike by every
    rank)."""
    return any(
        c.__module__ == "gpukit.errors" and c.__name__ in _BAD_INPUT for c in type(err).__mro__
    )


def report_bad_input(err: BaseException, where: str | None = None) -> bool:
    """Under gpukit's launcher, record ``err`` as bad input for the launcher to print once for
    the whole job (it then exits 2, as a command does on bad input), and return True: the
    rank prints nothing itself, or every rank would print the same lines. False elsewhere
    (torchrun, a single process): the caller reports it as usual."""
    if not os.environ.get("GPUKIT_JOB_DIR") or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    record(err, {"bad_input": str(err), **({"where": where} if where else {})})
    return True


def report_repeating(err: BaseException) -> None:
    """Under gpukit's launcher, record ``err``, a gpukit error a restart would meet again that
    the command prints itself (a file the disk refused), unless this process recorded its
    failure already: the launcher then knows this rank failed of its own (the others only
    lost it) and does not restart the job."""
    if os.environ.get("GPUKIT_JOB_DIR") and not _recorded():
        record(err)


def _recorded() -> bool:
    """Whether this process already wrote its error file (its own record is the better one)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return path is not None and os.path.exists(path)


def _raised_at(err: BaseException, script: str | None) -> str | None:
    """``train.py:12``: the script's own line the error came from (its innermost frame)."""
    tb, where = err.__traceback__, None
    while tb is not None:
        code = tb.tb_frame.f_code
        if script is not None and code.co_filename == script:
            where = f"{os.path.basename(script)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def scripts_frames(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on (None when it never ran: a SyntaxError)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return tb


def _past_runner(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without its leading frames of this file and of runpy (``-m`` mode)."""
    own = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or "")}
    while tb is not None and (
        os.path.abspath(tb.tb_frame.f_code.co_filename) in own
        or tb.tb_frame.f_code.co_filename.startswith("<frozen ")
    ):
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
