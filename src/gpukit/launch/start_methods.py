"""How ``rt.launch`` starts its processes: spawned, or forked where spawning cannot work.

``rt.launch`` runs its ranks under ``gpukit launch``'s supervisor (``gpukit.launch.functions``).
Each rank is a fresh interpreter that imports ``fn`` by name ("spawn", as multiprocessing names
it) when that can work. A function the new interpreter could not import (one defined in
``python -c``, a notebook or the interactive prompt, whose ``__main__`` has no file; a lambda or
a nested function) is run in forked processes instead, where the platform can fork and CUDA has
not been initialised in this process (a forked child cannot use CUDA then); otherwise a
:class:`LaunchError` says why and what to do.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from gpukit.errors import LaunchError


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
