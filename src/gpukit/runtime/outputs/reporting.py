"""What the Runtime tells its loggers (``gk.Runtime(loggers=[...])``; see
:mod:`gpukit.loggers`): the part behind ``rt.loggers`` and ``rt.log_hyperparams``.

Rank 0 alone talks to the loggers. When the run is ready (its first ``rt.setup``, step or
collective) they get the Runtime's settings as hyper-parameters, under ``runtime/``; then each
record ``rt.history`` gains, from a flush of ``rt.log`` or from ``rt.log_metrics``: values
already read back, so a logger adds no read, copy or collective to the step. Under gpukit's
launcher, the job's events about this run's ranks (a straggler named, one recovered) follow
each record, at its step (:mod:`gpukit.runtime.outputs.job_events`). They are
finalized when the function ``rt.launch`` runs returns (``"success"``) or raises
(``"failed"``), and at ``rt.teardown()`` if not before (``"failed"`` when it runs while an
exception is on its way out, as in a ``finally:`` block, else ``"success"``).

A logger that fails stops the run with a :class:`~gpukit.errors.LoggerError` naming it (its
error is the cause): training on without the log it was asked for would lose it silently. A
logger whose files the disk refuses (an ``OSError``: full, read-only, too large) stops it with
a :class:`~gpukit.errors.LoggerWriteError`, also an :class:`~gpukit.errors.OutputWriteError`
naming the file, the errno and the fix: a restart would meet the same disk.
While the run is already failing, a logger's failure to finalize is only logged, so that the
first error is the one raised.

>>> import gpukit as gk
>>> class Printer(gk.loggers.BaseLogger):
...     def log_metrics(self, metrics, step):
...         print(step, metrics)
>>> rt = gk.Runtime(devices="cpu", loggers=[Printer()])
>>> _ = rt.log_metrics(val_loss=0.25)
0 {'val_loss': 0.25}
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Protocol

from gpukit._util.files import write_error
from gpukit.errors import ConfigError, LoggerError, LoggerWriteError, OutputWriteError
from gpukit.loggers.base import Logger, logger_name
from gpukit.runtime.outputs.job_events import JobEvents
from gpukit.strategies import Strategy

_log = logging.getLogger("gpukit")


class AtStep(Protocol):
    """Where the run stands (the Runtime's ``TrainState``): the step a failure names."""

    @property
    def global_step(self) -> int: ...


class Reporting:
    """The Runtime's ``loggers`` (``rt.loggers``, made from its settings) and what they have
    been told: first ``settings``, the settings' record as ``metrics.json`` holds it, as
    hyper-parameters; spoken to from rank 0 of ``strategy`` alone (the Runtime gives it the new
    one when ``strategy="auto"`` replaces it, so the settings name the strategy trained with);
    ``state`` gives the step a failure names; ``events``, the launcher's events of the job
    (rank 0's, when a launcher keeps them)."""

    def __init__(
        self,
        loggers: list[Logger],
        settings: dict[str, Any],
        state: AtStep,
        strategy: Strategy,
        events: JobEvents | None = None,
    ) -> None:
        self.loggers = loggers
        self.settings, self.state, self.strategy = settings, state, strategy
        self.events = events
        self.broken: set[int] = set()  # id() of each logger that raised: said once already
        self.stage: Literal["idle", "started", "finished"] = "idle"

    def log_hyperparams(self, /, params: dict[str, Any] | None = None, **more: Any) -> None:
        """Send hyper-parameters of the program's own (``params`` and keywords: numbers,
        text, bools) to the loggers, from rank 0; the Runtime's settings go there by
        themselves.

        >>> import gpukit as gk
        >>> gk.Runtime(devices="cpu").log_hyperparams(lr=0.1, layers=4)  # no logger: nothing
        """
        values = {**(params or {}), **more}
        if not values:
            raise ConfigError(
                "rt.log_hyperparams() got nothing: pass a dict or keywords, e.g. "
                "rt.log_hyperparams(lr=0.1)"
            )
        if self._here():
            self.start()
            self._each("log_hyperparams", values)

    def _here(self) -> bool:
        return bool(self.loggers) and self.stage != "finished" and self.strategy.rank == 0

    def start(self) -> None:
        """Rank 0, once: the settings as the first hyper-parameters."""
        if self.stage == "idle" and self._here():
            self.stage = "started"
            # The strategy trained with, in place of the one asked for (as metrics.json has it).
            settings = {**self.settings, "strategy": self.strategy.name}
            self._each("log_hyperparams", {f"runtime/{k}": v for k, v in settings.items()})

    def record(self, rec: dict[str, float]) -> None:
        """A record ``rt.history`` gained, for the loggers."""
        if self._here():
            self.start()
            metrics = {k: v for k, v in rec.items() if k != "step"}
            self._each("log_metrics", metrics, int(rec["step"]))
            if self.events is not None:  # a read of memory, unless the launcher said more
                for told in self.events.news():
                    self._each("log_metrics", told, int(rec["step"]))

    def finish(self, status: Literal["success", "failed"]) -> None:
        """Finalize every started logger once; while failing, their errors are only logged."""
        started, self.stage = self.stage == "started", "finished"
        if not started:
            return
        if status == "success" and not self.broken:
            self._each("finalize", status)
            return
        # A logger that raised was said to fail then (the program may have caught it and
        # gone on): its finalize, likely failing the same way, is not a second error.
        for logger in self.loggers:
            if status == "success" and id(logger) not in self.broken:
                self._each_one(logger, "finalize", status)
                continue
            try:
                logger.finalize(status)
            except Exception as err:
                _log.warning("logger %s failed to finalize: %r", logger_name(logger), err)

    def _each(self, method: str, *args: Any) -> None:
        for logger in self.loggers:
            self._each_one(logger, method, *args)

    def _each_one(self, logger: Logger, method: str, *args: Any) -> None:
        try:
            getattr(logger, method)(*args)
        except OSError as err:  # the disk refused the logger (or the library it calls)
            self.broken.add(id(logger))
            raise _write_failure(logger, method, err, self.state.global_step) from err
        except Exception as err:
            self.broken.add(id(logger))
            refused = _os_error_under(err)  # MLflow wraps the disk's refusal in its own error
            if refused is not None:
                raise _write_failure(logger, method, refused, self.state.global_step) from err
            raise LoggerError(
                f"logger {logger_name(logger)} failed in {method} at step "
                f"{self.state.global_step}: {type(err).__name__}: {err}. The run stops "
                "rather than train on without the log it was asked for (rt.history holds "
                "every record so far): fix what the logger needs, or leave it out of "
                "gk.Runtime(loggers=...)"
            ) from err


def _os_error_under(err: BaseException) -> OSError | None:
    """The ``OSError`` a library's own exception was raised from or while handling, if any."""
    seen: set[int] = set()
    under = err.__cause__ or err.__context__
    while under is not None and id(under) not in seen:
        if isinstance(under, OSError):
            return under
        seen.add(id(under))
        under = under.__cause__ or under.__context__
    return None


def _write_failure(logger: Logger, method: str, err: OSError, step: int) -> LoggerWriteError:
    """The disk refused a logger's write: the logger, the call, and the file (the one the
    error names, else the logger's folder) with the errno and the fix. A logger of gpukit's
    own said it already (an OutputWriteError); a library's ``OSError`` is worded here."""
    name = logger_name(logger)
    said = err
    if not isinstance(err, OutputWriteError):
        where = err.filename if isinstance(err.filename, str) else getattr(logger, "folder", None)
        said = write_error(
            where if where is not None else f"the files of logger {name}",
            err,
            kept="the run stops rather than train on without its log (rt.history holds every "
            "record so far)",
            option="--out, or the logger's folder; or leave the logger out of "
            "gk.Runtime(loggers=...)",
        )
    error = LoggerWriteError(
        f"logger {name} failed in {method} at step {step}: {type(err).__name__}: {said}"
    )
    error.errno, error.path = said.errno, getattr(said, "path", None)
    return error
