"""A command's flags for the run's settings, made from their declarations
(:mod:`gpukit.runtime.settings`): the flag, its values, its help and ``gpukit train``'s default.

>>> parser = argparse.ArgumentParser()
>>> add_setting_flags(parser)
>>> values(parser.parse_args(["--log-every", "5"]))["log_every"]
5
"""

from __future__ import annotations

import argparse
from typing import Any

from gpukit.runtime import settings as _settings
from gpukit.runtime.settings import Settings


def add_setting_flags(
    parser: argparse.ArgumentParser, cls: type[Settings] = Settings, skip: tuple[str, ...] = ()
) -> None:
    """A flag for each setting of ``cls`` that has one (but those named in ``skip``, which
    the command adds itself), with ``gpukit train``'s default."""
    group = parser.add_argument_group(
        "run settings (gk.Runtime's keywords; every setting and default: docs/settings.md)"
    )
    for f in _settings.fields(cls):
        flag = _settings.flag_name(f)
        if flag is None or f.name in skip:
            continue
        meta = _settings.option(f)
        group.add_argument(
            flag,
            type=meta.parse,
            choices=meta.choices,
            default=_settings.train_default(f),
            metavar=meta.metavar,
            help=help_text(f),
        )


def help_text(f: Any) -> str:
    """A setting's --help: what it does, and the default when there is one to show."""
    meta, default = _settings.option(f), _settings.train_default(f)
    if meta.train_default is not _settings.SAME:
        return f"{meta.help} (default here {default}, gk.Runtime's {f.default}: {meta.why})"
    return meta.help if default is None else f"{meta.help} (default {default})"


def values(args: argparse.Namespace, cls: type[Settings] = Settings) -> dict[str, Any]:
    """The settings the flags of ``cls`` gave (every one that has a flag)."""
    return {
        f.name: getattr(args, f.name)
        for f in _settings.fields(cls)
        if _settings.flag_name(f) is not None
    }


def command_line(
    args: argparse.Namespace, cls: type[Settings] = Settings, skip: tuple[str, ...] = ()
) -> list[str]:
    """The flags that give the same settings again (those not None), for another process."""
    line: list[str] = []
    for f in _settings.fields(cls):
        flag, value = _settings.flag_name(f), getattr(args, f.name, None)
        if flag is not None and value is not None and f.name not in skip:
            line += [flag, str(value)]
    return line
