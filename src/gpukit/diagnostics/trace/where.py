"""Which line of the user's code an event of ``gk.trace()`` belongs to.

The innermost Python frame of the user's own code: not a library's, that is not under torch's
or numpy's package directory, not in any ``site-packages`` or ``dist-packages`` folder (every
installed package: numpy reading a tensor index, a trainer's logging call), not in the standard
library (``contextlib``, ``logging``, the frozen ``runpy``...), and not under gpukit's own
directory, except ``gpukit/train/`` and ``gpukit/workloads/`` and the bench's nanoGPT-style
loop, which stand in for the user's code (``gpukit trace --workload`` shows gpukit train's
loop). Files are classified once and cached.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig

import torch

Where = tuple[str, int, str]  # file, line, function
# Where an event with no frame of the user's code on its stack is counted.
NO_USER_FRAME: Where = ("<no frame of your code>", 0, "?")
NO_PYTHON_FRAME: Where = ("<autograd or C++ thread>", 0, "?")


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations))) + os.sep


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
# Torch code that keeps its own tensors on the CPU on purpose, on GPU runs too, and reads them:
# optimizers' step counters, samplers' random numbers. Those reads are no syncs.
_HOST_SIDE_DIRS = tuple(_TORCH_DIR + d + os.sep for d in ("optim", os.path.join("utils", "data")))
# gpukit/diagnostics/trace/where.py -> gpukit/
_GPUKIT_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..")) + os.sep
_GPUKIT_USER = (
    _GPUKIT_DIR + "train" + os.sep,
    _GPUKIT_DIR + "workloads" + os.sep,
    os.path.join(_GPUKIT_DIR, "bench", "nanogpt_loop.py"),
)
# Libraries found wherever they are installed (a source checkout on PYTHONPATH, a system
# folder): numpy reads tensors used as indices, and calls back into Python while it does.
_LIBRARY_DIRS = tuple(d for d in (_TORCH_DIR, _package_dir("numpy")) if d is not None)
_STDLIB = tuple(
    os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")
)
_SITE = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))
# Any folder of installed packages, ours or another interpreter's (``--user`` installs, conda).
_INSTALLED = tuple(os.sep + d + os.sep for d in ("site-packages", "dist-packages"))
_USER, _GPUKIT, _HOST_SIDE, _LIBRARY = range(4)
_file_kind: dict[str, int] = {}  # co_filename -> one of the four above


def _classify(filename: str) -> int:
    if filename.startswith("<"):
        # Frozen standard modules (runpy, os, importlib) are named "<frozen runpy>"; other
        # names in brackets are code typed in: "<stdin>", "<string>", a notebook's cell.
        return _LIBRARY if filename.startswith("<frozen ") else _USER
    path = os.path.realpath(filename)
    if path.startswith(_GPUKIT_DIR):
        return _USER if path.startswith(_GPUKIT_USER) else _GPUKIT
    if path.startswith(_HOST_SIDE_DIRS):
        return _HOST_SIDE
    if path.startswith(_LIBRARY_DIRS + _SITE + _STDLIB) or any(d in path for d in _INSTALLED):
        return _LIBRARY
    return _USER


def user_frame() -> tuple[Where, bool]:
    """The innermost frame of user code, and whether the code that called into gpukit's hook
    is torch's host-side bookkeeping (``_HOST_SIDE_DIRS``)."""
    frame = sys._getframe(1)
    first_library = _USER  # the kind of the innermost frame outside gpukit
    outside = False  # whether any frame was not gpukit's
    while frame is not None:
        code = frame.f_code
        kind = _file_kind.get(code.co_filename)
        if kind is None:
            kind = _file_kind[code.co_filename] = _classify(code.co_filename)
        if kind == _USER:
            where = (code.co_filename, frame.f_lineno or 0, code.co_name)
            return where, first_library == _HOST_SIDE
        if not outside and kind != _GPUKIT:
            first_library, outside = kind, True
        frame = frame.f_back  # type: ignore[assignment]
    # Only libraries' and gpukit's frames (code run by a library's own entry point), or none
    # at all (CUDA's autograd worker thread): never a library's line, which the user cannot fix.
    return (NO_USER_FRAME if outside else NO_PYTHON_FRAME), first_library == _HOST_SIDE
