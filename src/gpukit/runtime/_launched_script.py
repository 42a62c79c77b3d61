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
one line saying what it was.

Before the script starts, ``SIGUSR1`` is set to write every thread's Python stack to
``GPUKIT_JOB_DIR/stack-<rank>-<attempt>.txt`` (when the launcher set ``GPUKIT_JOB_DIR``): the
launcher asks for it when a rank stops beating, to show where each rank was.

This file is run by path, not imported as ``gpukit...``: importing the package would import
torch before the script has had a chance to set its environment. So it reads its few variables
itself, and must import nothing beyond the standard library.

    python _launched_script.py train.py --epochs 3
    python _launched_script.py -m gpukit train --workload mlp
"""

from __future__ import annotations

import faulthandler
import functools
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
    if args[:1] == ["-m"]:
        module, *rest = args[1:]
        sys.argv = [module, *rest]  # run_module puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        target: Callable[[], Any] = functools.partial(
            runpy.run_module, module, run_name="__main__", alter_sys=True
        )
        script = None
    else:
        script, *rest = args
        sys.argv = [script, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        target = functools.partial(runpy.run_path, script, run_name="__main__")
    try:
        target()
    except SystemExit as stop:
        if stop.code not in (None, 0):
            record(stop)
        raise
    except Exception as err:  # KeyboardInterrupt and the like end the process as usual
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
        sys.exit(1)


def record(err: BaseException) -> None:
    """Write ``err`` to the error file, in torchrun's format plus ``time_ns``."""
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
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        pass  # the script's own error matters more than our record of it


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
