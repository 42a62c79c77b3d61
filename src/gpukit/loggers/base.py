"""What a logger is: three calls, the names Lightning Fabric's loggers use.

A logger receives what ``gk.Runtime`` records, on rank 0 only:

- ``log_hyperparams(params)``: once when the run starts (the Runtime's settings, under
  ``runtime/...``), and again for each ``rt.log_hyperparams(...)``;
- ``log_metrics(metrics, step)``: each record ``rt.history`` gains (a flush of ``rt.log``, or
  a ``rt.log_metrics`` call), as Python floats already read back, with the optimizer step;
- ``finalize(status)``: once at the end, ``"success"`` or ``"failed"``.

Any object with these three methods is a logger (:class:`Logger`, a ``Protocol``); subclass
:class:`BaseLogger` to write only the ones you need.

>>> class Printer(BaseLogger):
...     def log_metrics(self, metrics, step):
...         print(step, metrics)
>>> Printer().log_metrics({"loss": 0.5}, step=10)
10 {'loss': 0.5}
>>> isinstance(Printer(), Logger)
True
"""

from __future__ import annotations

import importlib.util
from typing import Any, Protocol, runtime_checkable

from gpukit.errors import ConfigError

STATUSES = ("success", "failed")


@runtime_checkable
class Logger(Protocol):
    """A destination for a run's hyper-parameters and metrics (see the module docstring)."""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's hyper-parameters (names to numbers, text, bools or None)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (names to floats) at optimizer step ``step``."""

    def finalize(self, status: str) -> None:
        """The run ended (``"success"`` or ``"failed"``): write out what is buffered, close."""


class BaseLogger:
    """A logger that does nothing: subclass it and write the calls you need.

    ``name`` is how errors and ``rt.loggers`` show it (default: the class's name).
    """

    name: str = ""

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's hyper-parameters (default: nothing)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step`` (default: nothing)."""

    def finalize(self, status: str) -> None:
        """The run ended with ``status`` (default: nothing)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def logger_name(logger: object) -> str:
    """How messages name ``logger``: its ``name``, else its class's name.

    >>> logger_name(BaseLogger())
    'BaseLogger'
    """
    name = getattr(logger, "name", "")
    return name if isinstance(name, str) and name else type(logger).__name__


def require(package: str, extra: str, logger: str) -> None:
    """Refuse to make ``logger`` when ``package`` is not installed, naming the pip extra.
    Only looks the package up: importing it waits until the logger first writes.

    >>> require("a_package_that_is_not_there", "tensorboard", "TensorBoardLogger")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: TensorBoardLogger needs the a_package_that_is_not_there ...
    """
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"{logger} needs the {package} package, which is not installed: "
            f'pip install "gpukit[{extra}]" (or pip install {package})'
        )


def plain_params(params: dict[str, Any]) -> dict[str, int | float | str | bool]:
    """``params`` with every value a number, text or bool (others as text), as trackers take
    hyper-parameters.

    >>> plain_params({"lr": 0.1, "devices": ["cpu", "cpu"], "clip": None})
    {'lr': 0.1, 'devices': "['cpu', 'cpu']", 'clip': 'None'}
    """
    return {
        str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in params.items()
    }
