"""One ``torch.profiler`` at a time: a second one started while a gpukit profile records
(``rt.profile`` inside ``rt.profile``, or ``torch.profiler.profile`` in a script under
``gpukit trace --profile``) crashes the process with a segmentation fault inside torch's
profiler, with no word of why. So a gpukit profile is refused when any profiler already
records, and while one is open, starting another ``torch.profiler.profile`` (or the older
``torch.autograd.profiler.profile``) raises a :class:`~gpukit.errors.ConfigError` instead.

The second case is caught by wrapping the start of torch's profilers while a gpukit profile
is open (and only then: unwrapped again when the last one closes), since the crash comes from
torch's own code, where nothing else can see it coming.

>>> recording()
False
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from gpukit.errors import ConfigError

_SAID = (
    "two profilers at once crash the process (a segmentation fault inside torch's profiler): "
    "keep one. Under gpukit trace --profile, drop --profile (the script's own profiler then "
    "runs), or the script's torch.profiler.profile"
)
_originals: dict[tuple[type, str], Callable[..., Any]] = {}


def recording() -> bool:
    """Whether a torch profiler records in this process (any of them: gpukit's, the user's,
    the older autograd one). Both flags exist in torch 2.4 and later; absent ones count as
    not recording."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    legacy = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)
    return bool(legacy) or (callable(enabled) and bool(enabled()))


def refuse_if_recording(what: str) -> None:
    """Refuse to start ``what`` (a gpukit profile) while another profiler records."""
    if recording():
        raise ConfigError(f"{what}: another profiler is already recording, and {_SAID}")


def guard() -> None:
    """From now until :func:`unguard`: starting a torch profiler raises instead of crashing."""
    if _originals:
        return
    targets: list[tuple[type, str]] = [(torch.profiler.profile, "start")]
    legacy = getattr(torch.autograd.profiler, "profile", None)
    if isinstance(legacy, type):
        targets.append((legacy, "__enter__"))
    for owner, name in targets:
        original = owner.__dict__.get(name)
        if original is None:
            continue  # inherited: not where this torch starts it
        _originals[(owner, name)] = original
        setattr(owner, name, _refusing(original, f"{owner.__module__}.{owner.__qualname__}"))


def unguard() -> None:
    """Torch's profilers start as they do again."""
    for (owner, name), original in _originals.items():
        setattr(owner, name, original)
    _originals.clear()


def _refusing(original: Callable[..., Any], name: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise ConfigError(
            f"{name} started while a gpukit profile records (rt.profile, or gpukit trace "
            f"--profile), and {_SAID}"
        )

    return refused
