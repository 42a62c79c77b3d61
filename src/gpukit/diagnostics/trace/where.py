"""Which line of the user's code an event of ``gk.trace()`` belongs to.

The innermost Python frame that is not under torch's package directory, not under gpukit's
(except ``gpukit/workloads/``: the loop ``gpukit trace --workload`` runs is user code), and
not in the standard library. Files are classified once and cached.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import torch

Where = tuple[str, int, str]  # file, line, function


_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep
# Torch code that keeps its own tensors on the CPU on purpose, on GPU runs too, and reads them:
# optimizers' step counters, samplers' random numbers. Those reads are no syncs.
_HOST_SIDE_DIRS = tuple(_TORCH_DIR + d + os.sep for d in ("optim", os.path.join("utils", "data")))
# gpukit/diagnostics/trace/where.py -> gpukit/
_GPUKIT_DIR = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..")) + os.sep
_GPUKIT_USER = (_GPUKIT_DIR + "workloads" + os.sep,)
# The standard library (contextlib, threading, logging, ...) calls on behalf of its caller;
# site-packages may sit inside it outside a virtual environment.
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
_SITE = tuple(os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("purelib", "platlib"))
_USER, _GPUKIT, _HOST_SIDE, _LIBRARY = range(4)
_file_kind: dict[str, int] = {}  # co_filename -> one of the four above


def _classify(filename: str) -> int:
    path = filename if filename.startswith("<") else os.path.realpath(filename)
    if path.startswith(_GPUKIT_DIR):
        return _USER if path.startswith(_GPUKIT_USER) else _GPUKIT
    if path.startswith(_HOST_SIDE_DIRS):
        return _HOST_SIDE
    if path.startswith(_TORCH_DIR) or (path.startswith(_STDLIB) and not path.startswith(_SITE)):
        return _LIBRARY
    return _USER


def user_frame() -> tuple[Where, bool]:
    """The innermost frame of user code, and whether the code that called into gpukit's hook
    is torch's host-side bookkeeping (``_HOST_SIDE_DIRS``)."""
    frame = sys._getframe(1)
    first_library = _USER  # the kind of the innermost frame outside gpukit
    while frame is not None:
        code = frame.f_code
        kind = _file_kind.get(code.co_filename)
        if kind is None:
            kind = _file_kind[code.co_filename] = _classify(code.co_filename)
        if kind == _USER:
            where = (code.co_filename, frame.f_lineno or 0, code.co_name)
            return where, first_library == _HOST_SIDE
        if first_library == _USER and kind != _GPUKIT:
            first_library = kind
        frame = frame.f_back  # type: ignore[assignment]
    # No user frame at all: a thread without Python code, e.g. CUDA's autograd worker thread.
    return ("<autograd or C++ thread>", 0, "?"), first_library == _HOST_SIDE
