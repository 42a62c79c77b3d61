"""How a rank forked by the warm-start server runs its runner and ends.

A fresh interpreter ends by releasing every module it imported, torch's included. In a rank
forked warm those modules are the server's: releasing them writes the reference count of every
object they hold, so the kernel copies nearly every page the fork shared, about 0.3 s of CPU per
rank, most of what a short rank costs. A warm rank therefore ends as the interpreter does, step
for step, except for that release:

1. what the runner raised gives the exit code and the message, as the interpreter gives them
   (``SystemExit``'s code, or its message and 1; the traceback of an uncaught error and 1);
2. the threads that are not daemons are joined, then the ``atexit`` handlers run;
3. the modules the rank imported itself are released, newest first, and a collection follows:
   the finalizers of the objects they held run as at any exit (the runner's own namespace, its
   ``__main__``, was dropped when it returned);
4. every object the rank made that is still alive and has a finalizer has it run, as the release
   of the server's modules would have (an object the rank stored in torch's or gpukit's state,
   a file it left open: files last, a wrapper before what it wraps); an error in one is
   reported as the interpreter reports it (``sys.unraisablehook``);
5. the standard streams and C's stdio buffers are flushed and the process ends (``os._exit``),
   or, after an uncaught ``KeyboardInterrupt``, dies of SIGINT as Python makes it.

What differs from a cold exit: the server's own objects are never released (none of them is the
rank's), and the order in which the rank's objects are finalized, which Python leaves open too.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import io
import os
import runpy
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import NoReturn


def run(runner: str) -> NoReturn:
    """Run ``runner`` as ``__main__`` in this forked rank, then end as described above."""
    preloaded = set(sys.modules)
    code, interrupted = _run(runner)
    try:
        _finish(preloaded)
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # the exit code stays the runner's, as at any exit
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(code)


def _run(runner: str) -> tuple[int, bool]:
    """The exit code the interpreter would give, and whether a KeyboardInterrupt ended it."""
    try:
        runpy.run_path(runner, run_name="__main__")  # its namespace is dropped on return
    except SystemExit as stop:
        return exit_code(stop.code), False
    except BaseException as err:
        sys.excepthook(type(err), err, err.__traceback__)
        return 1, isinstance(err, KeyboardInterrupt)
    return 0, False


def exit_code(code: object) -> int:
    """What the interpreter exits with for ``SystemExit(code)``, printing a message as it does.

    >>> exit_code(None), exit_code(3)
    (0, 3)
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # what the kernel keeps of it
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def _finish(preloaded: set[str]) -> None:
    # threading._shutdown is the interpreter's own first step at exit: it joins every thread
    # that is not a daemon (and is what `threading` documents the exit to do).
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    _flush_standard_streams()
    for name in reversed(list(sys.modules)):
        if name not in preloaded:
            sys.modules.pop(name, None)
    gc.collect()
    _finalize_what_is_left()
    _flush_standard_streams()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)  # C's stdio: what exit(3) would flush


# What only wraps a buffer or a file descriptor: closed after the wrappers around it.
_BUFFERS = (io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair)


def _finalize_what_is_left() -> None:
    """Run the finalizer of every object the rank made that is still alive (the server's are
    frozen: ``gc`` does not list them), as the release of the modules holding them would:
    newest first, then the files, wrappers before what they wrap."""
    standard: set[int] = set()
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        buffer = getattr(stream, "buffer", None)
        standard |= {id(stream), id(buffer), id(getattr(buffer, "raw", None))}
    alive = [
        obj
        for obj in gc.get_objects()
        if id(obj) not in standard and getattr(type(obj), "__del__", None) is not None
    ]
    files = sorted((obj for obj in alive if isinstance(obj, io.IOBase)), key=_close_rank)
    others = [obj for obj in reversed(alive) if not isinstance(obj, io.IOBase)]
    for obj in [*others, *files]:
        finalizer = type(obj).__del__
        try:
            finalizer(obj)
        except Exception as err:
            _report(err, finalizer)


def _report(err: Exception, finalizer: object) -> None:
    """Report a finalizer's error as the interpreter does (``sys.unraisablehook``)."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None  # from __del__ on
    if sys.unraisablehook is sys.__unraisablehook__:  # its argument type cannot be built
        print(f"Exception ignored in: {finalizer!r}", file=sys.stderr)
        traceback.print_exception(type(err), err, tb, file=sys.stderr)
    else:
        sys.unraisablehook(_Unraisable(type(err), err, tb, object=finalizer))


@dataclass  # settable, as the hook's own argument type declares its fields
class _Unraisable:
    """What a ``sys.unraisablehook`` of the user's reads: the error, the finalizer that raised."""

    exc_type: type[BaseException]
    exc_value: BaseException | None
    exc_traceback: TracebackType | None
    err_msg: str | None = "Exception ignored in"
    object: object = None


def _close_rank(file: io.IOBase) -> int:
    """0 for text, 1 for another wrapper (``gzip``, ``bz2``, ``lzma``), 2 a buffer, 3 raw."""
    if isinstance(file, io.TextIOBase):
        return 0
    if isinstance(file, _BUFFERS):
        return 2
    if isinstance(file, io.RawIOBase):
        return 3
    return 1


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
