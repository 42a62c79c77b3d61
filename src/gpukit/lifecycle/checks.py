"""The settings the run's boundaries read (checkpoints, saving by itself, resuming) and their
checks: apart from the boundaries themselves, so that :mod:`gpukit.runtime.settings` can
declare them without importing everything the boundaries use (the checkpoint package, which
imports the settings back).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Protocol

from gpukit.errors import ConfigError

ResumePolicy = Literal["auto"] | None
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_save_every(value: int | str | None) -> tuple[int | None, float | None]:
    """``save_every`` as (steps, seconds): ``4`` or ``"4"`` is every 4 steps, ``"10m"`` every
    10 minutes (units s, m, h); None saves only when asked."""
    if value is None:
        return None, None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value, None
    text = value.strip() if isinstance(value, str) else ""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([smh]?)", text, re.ASCII)
    if match and not match.group(2) and "." not in match.group(1) and int(match.group(1)) >= 1:
        return int(match.group(1)), None
    if match and match.group(2) and float(match.group(1)) > 0:
        return None, float(match.group(1)) * _UNITS[match.group(2)]
    raise ConfigError(
        f"save_every={value!r}: give a number of optimizer steps (e.g. 4, --save-every 4) or a "
        "time with its unit, s, m or h (e.g. '10m', --save-every 10m)"
    )


class LifecycleSettings(Protocol):
    """The settings the boundaries read: checkpoints and resuming (declared, with their
    defaults, in :class:`gpukit.runtime.settings.Settings`)."""

    @property
    def checkpoints(self) -> str | Path | None: ...
    @property
    def save_every(self) -> int | str | None: ...
    @property
    def keep(self) -> int: ...
    @property
    def resume(self) -> ResumePolicy: ...


def check_checkpoints(checkpoints: object) -> None:
    """ConfigError for an empty folder name (None: no checkpoints)."""
    if checkpoints is not None and not str(checkpoints).strip():
        raise ConfigError("checkpoints='': give the folder for checkpoints, or None to keep none")


def check_keep(keep: object) -> None:
    """ConfigError unless ``keep`` keeps at least one checkpoint."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ConfigError(f"keep={keep!r}: keep at least the newest checkpoint (keep=1)")


def check_resume(resume: object) -> None:
    """ConfigError unless ``resume`` is a resume policy."""
    if resume not in ("auto", None):
        raise ConfigError(
            f"resume={resume!r}: use 'auto' (continue from the newest good checkpoint "
            "in checkpoints= when there is one, else start fresh) or None"
        )


def check_needs_folder(settings: LifecycleSettings) -> None:
    """Saving by itself and resuming both need a checkpoints folder."""
    steps, seconds = parse_save_every(settings.save_every)
    if (steps or seconds or settings.resume) and settings.checkpoints is None:
        what = "save_every" if steps or seconds else "resume='auto'"
        raise ConfigError(
            f"{what} needs a folder for the checkpoints: gk.Runtime(checkpoints='ckpt', ...)"
        )
