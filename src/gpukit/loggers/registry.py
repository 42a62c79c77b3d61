"""Loggers by name: ``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"``.

A name stands for the logger made with a folder: the run's folder, which ``gk.Runtime`` takes
to be the parent of its ``checkpoints`` folder (``gpukit train --out DIR``: ``DIR``). Each
writes under it: ``csv`` -> ``metrics.csv`` (and ``hyperparams.json``), ``tensorboard`` ->
``tensorboard/``, ``wandb`` -> ``wandb/``, ``mlflow`` -> ``mlruns/``.

>>> [type(x).__name__ for x in make_loggers(["csv"], "runs/a")]
['CsvLogger']
>>> make_loggers(["csv"], None)
Traceback (most recent call last):
...
gpukit.errors.ConfigError: loggers=['csv'] names a logger, which writes under the run's ...
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpukit.errors import ConfigError
from gpukit.loggers.base import Logger
from gpukit.loggers.csv_logger import CsvLogger
from gpukit.loggers.mlflow_logger import MLflowLogger
from gpukit.loggers.tensorboard_logger import TensorBoardLogger
from gpukit.loggers.wandb_logger import WandbLogger

LoggerSpec = str | Logger
LoggersSpec = LoggerSpec | Sequence[LoggerSpec] | None

# Each name's logger, made for the run's folder.
NAMES: dict[str, Callable[[Path], Logger]] = {
    "csv": lambda folder: CsvLogger(folder),
    "tensorboard": lambda folder: TensorBoardLogger(folder / "tensorboard"),
    "wandb": lambda folder: WandbLogger(folder=folder),
    "mlflow": lambda folder: MLflowLogger(folder / "mlruns"),
}


def specs(value: Any) -> list[Any]:
    """``loggers=`` as a list: None is none, one name or logger is a list of one."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        return [value]
    return list(value)


def check_loggers(value: Any, folder: str | os.PathLike[str] | None) -> None:
    """Refuse ``loggers=`` that is not names and loggers, an unknown name, or a name without
    a folder to write in (``folder``: the run's, None when it has none)."""
    for spec in specs(value):
        if isinstance(spec, str):
            if spec not in NAMES:
                raise ConfigError(
                    f"loggers: unknown logger {spec!r}: use {', '.join(NAMES)}, or a logger "
                    "object (see gpukit.loggers)"
                )
            if folder is None:
                raise ConfigError(
                    f"loggers={specs(value)!r} names a logger, which writes under the run's "
                    "folder, but the run has none: give checkpoints='DIR/checkpoints' (named "
                    "loggers then write under DIR), or a logger with its folder, e.g. "
                    "gk.loggers.CsvLogger('runs/a')"
                )
        elif not isinstance(spec, Logger):
            missing = [
                m for m in ("log_hyperparams", "log_metrics", "finalize") if not hasattr(spec, m)
            ]
            raise ConfigError(
                f"loggers: {spec!r} is not a logger (it has no {', '.join(missing)}): give "
                f"names ({', '.join(NAMES)}) or objects with log_hyperparams(params), "
                "log_metrics(metrics, step) and finalize(status), e.g. a subclass of "
                "gk.loggers.BaseLogger"
            )
    _check_once_each(value)


def _check_once_each(value: Any) -> None:
    """Refuse a logger named or given twice: both would write the same files (a name) or see
    every metric twice (an object)."""
    seen: list[Any] = []
    for spec in specs(value):
        if any(spec is s or (isinstance(spec, str) and spec == s) for s in seen):
            raise ConfigError(
                f"loggers={specs(value)!r}: {spec!r} is given twice, and both would write "
                "the same metrics (a name: into the same files): give each logger once"
            )
        seen.append(spec)


def make_loggers(value: Any, folder: str | os.PathLike[str] | None) -> list[Logger]:
    """The loggers ``loggers=`` asks for: names made for ``folder``, objects as given."""
    check_loggers(value, folder)
    return [
        NAMES[spec](Path(str(folder))) if isinstance(spec, str) else spec for spec in specs(value)
    ]


def parse_names(text: str) -> list[str]:
    """A command line's comma list of logger names, checked.

    >>> parse_names("csv,tensorboard")
    ['csv', 'tensorboard']
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"--logger {text!r}: {', '.join(twice)} given twice, and both would write the same "
            "files: give each logger once"
        )
    if unknown or not names:
        raise ConfigError(
            f"--logger {text!r}: unknown logger {', '.join(map(repr, unknown)) or '(none)'}: "
            f"give a comma list of {', '.join(NAMES)} (e.g. --logger csv,tensorboard)"
        )
    return names
