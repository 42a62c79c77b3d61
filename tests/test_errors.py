"""Every error class gpukit raises is importable from ``gpukit`` itself."""

from __future__ import annotations

import importlib
import pkgutil

import gpukit as gk
from gpukit.errors import GpukitError


def _all_subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_all_subclasses(sub)}
    return found


def test_every_gpukit_error_is_exported() -> None:
    # Import every module first, so a subclass defined anywhere in the package is seen.
    for info in pkgutil.walk_packages(gk.__path__, "gpukit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    classes = {c for c in _all_subclasses(GpukitError) if c.__module__.startswith("gpukit")}
    assert classes  # the walk found the tree
    missing = sorted(c.__name__ for c in classes if getattr(gk, c.__name__, None) is not c)
    assert missing == [], f"not exported from gpukit: {missing}"
    assert all(c.__name__ in gk.__all__ for c in classes)
    assert gk.GpukitError is GpukitError


def test_translated_errors_are_still_runtime_errors() -> None:
    for cls in (gk.CrossDeviceError, gk.DistributedError, gk.OutOfMemory, gk.CudnnError):
        assert issubclass(cls, RuntimeError) and issubclass(cls, gk.GpukitError)
