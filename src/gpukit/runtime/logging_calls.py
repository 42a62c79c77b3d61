"""The Runtime's metric methods: ``rt.log``, ``rt.log_metrics`` and ``rt.flush_logs``, and the
logging window it closes where every rank is (the sums themselves:
:mod:`gpukit.runtime.outputs.metrics`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpukit.runtime.outputs.metrics import Metrics, checked_step
from gpukit.runtime.state import TrainState


class Logging:
    """What ``rt.log`` and its kin do with ``metrics``, stamped with ``state``'s step;
    ``ready`` joins the process group before a read-back that may be collective."""

    def __init__(self, metrics: Metrics, state: TrainState, ready: Callable[[], None]) -> None:
        self.metrics, self.state, self.ready = metrics, state, ready

    def log(self, /, **metrics: torch.Tensor | float) -> None:
        """Accumulate metrics on the device; every ``log_every`` calls, average them over the
        calls and the ranks, read them back once, and append them to ``rt.history``."""
        self.metrics.log(self.state.global_step, metrics)

    def log_metrics(
        self, /, step: int | None = None, **metrics: torch.Tensor | float
    ) -> dict[str, float]:
        """Record values the program computed itself (a validation loss, an accuracy) as they
        are: appended to ``rt.history`` on this rank, no averaging over ranks (combine them
        first, e.g. with ``rt.gather_for_metrics`` or ``rt.all_reduce``), and written by the
        loggers on rank 0. A tensor is read back once here. Returns the record.

        ``step``: the step to record them at, a whole number 0 or more, as Accelerate's
        ``accelerator.log(values, step=n)`` and Fabric's ``fabric.log_dict(values, step=n)``
        take it; the record's ``"step"`` is that number (in ``rt.history`` and every logger),
        and ``rt.global_step`` is left as it is. Without it, the values are recorded at
        ``rt.global_step``. A step lower than an earlier record's is recorded as given (see
        ``docs/loggers.md`` for what each tracker does with it).

        >>> import gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> rt.log_metrics(val_loss=0.25, step=3)
        {'step': 3, 'val_loss': 0.25}
        """
        at = self.state.global_step if step is None else checked_step(step)
        return self.metrics.record(at, metrics)

    def flush_logs(self) -> dict[str, float]:
        """Read back what ``log`` accumulated now (every rank must call it together)."""
        self.ready()
        return self.metrics.flush(self.state.global_step)

    def close_window(self) -> None:
        """Read back what ``log`` has pending: only where every rank is (the end of a pass,
        a save, the end of the launched function), since it is collective."""
        if self.metrics.pending:
            self.metrics.flush(self.state.global_step)
