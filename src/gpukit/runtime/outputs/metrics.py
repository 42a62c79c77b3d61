"""Metrics kept on the device and read back once per flush.

``log(step, {"loss": loss})`` adds each value to a running sum on the device: no read-back, so
the GPU never waits for the host. Every ``log_every`` calls (and on ``flush``) the means are
read back once and appended to ``history``.

Under several processes a flush is one all-reduce and one read, whatever the number of
metrics. Every rank must log the same names; that is checked in the same all-reduce: besides the
values (padded to a fixed length, so that ranks that logged different names still send tensors
of one size), each rank adds its count of names and the four bytes of a CRC-32 of them, and
their squares. Integers that are all equal are exactly those whose sum squared equals the
number of ranks times the sum of their squares, so every rank sees the same verdict from the
same sums and raises together, without a second collective or read.

>>> import torch
>>> from gpukit.strategies import make_strategy
>>> strategy = make_strategy("single")
>>> m = Metrics(torch.device("cpu"), log_every=2, strategy=strategy)
>>> m.log(0, {"loss": torch.tensor(1.0)})
>>> m.log(1, {"loss": torch.tensor(3.0)})
>>> m.history
[{'step': 1, 'loss': 2.0}]
"""

from __future__ import annotations

import numbers
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from gpukit._util.text import safe_repr, type_name
from gpukit.errors import ConfigError
from gpukit.strategies import Strategy

# Names one flush can carry under several processes (the all-reduce has a fixed length).
CAPACITY = 256
_CHECKS = 5  # the count of names and the four bytes of their CRC-32


class Window(Protocol):
    """What else a flush records about its window, measured on the host as the window went
    (the Runtime's ``gpukit.runtime.data.wait.DataWait``)."""

    def before_read(self) -> None:
        """Just before the window's read-back."""

    def close(self, step: int) -> dict[str, float]:
        """After the read-back: the window's values, added to its record."""
        ...


class Metrics:
    """Running sums of logged values on ``device``, read back every ``log_every`` calls;
    ``window`` adds its own values to each record a flush makes."""

    def __init__(
        self,
        device: torch.device,
        log_every: int,
        strategy: Strategy,
        window: Window | None = None,
    ) -> None:
        self.device = device
        self.log_every = log_every
        self.strategy = strategy
        self.window = window
        self.history: list[dict[str, float]] = []
        self._sums: dict[str, torch.Tensor] = {}  # name -> sum since the flush, on the device
        self._counts: dict[str, int] = {}
        self._calls = 0  # since the last flush: a window holds log_every calls at most
        self._checks: dict[tuple[str, ...], torch.Tensor] = {}  # names -> their check, on device
        # Called with each record appended to history (the Runtime's loggers): values already
        # read back, so it adds no read, copy or collective.
        self.on_record: Callable[[dict[str, float]], None] | None = None

    def log(self, step: int, metrics: dict[str, torch.Tensor | float]) -> None:
        """Add ``metrics`` to the sums; flush every ``log_every`` calls (``step``: the
        optimizer step the flushed record is stamped with)."""
        if not metrics:
            raise ConfigError("rt.log() got no metrics: pass them by name, e.g. rt.log(loss=loss)")
        if "step" in metrics:
            raise ConfigError(
                "rt.log(step=...): rt.log averages its values over a window of calls and over "
                "the ranks, and stamps the record with rt.global_step; to record values at a "
                "step of your own (Accelerate's accelerator.log(values, step=n), Fabric's "
                "fabric.log_dict(values, step=n)), use rt.log_metrics(step=n, **values)"
            )
        sums, counts = self._sums, self._counts
        for name, value in metrics.items():
            # Added now, not kept: a tensor changed in place later (a counter, a parameter)
            # must count with the value it had when it was logged. One device op, no read.
            t = _as_tensor(name, value)
            total = sums.get(name)
            if total is None:
                sums[name] = t.to(self.device, torch.float32, copy=True)
                counts[name] = 1
            else:
                total.add_(t if t.device == total.device else t.to(total.device))
                counts[name] += 1
        self._calls += 1
        if self._calls >= self.log_every:
            self.flush(step)

    @property
    def pending(self) -> bool:
        """Whether values were logged since the last flush."""
        return bool(self._sums)

    def flush(self, step: int) -> dict[str, float]:
        """Read back the means of what was logged since the last flush (one read; under several
        processes every rank must call it together), and append them to ``history``."""
        names = tuple(sorted(self._sums))
        self._calls = 0
        if self.window is not None and names:  # a record will be made of this window
            self.window.before_read()
        if not self.strategy.distributed:
            if not names:
                return {}
            means = torch.stack([self._sums[n] / self._counts[n] for n in names])
            values = means.tolist()
        else:
            # Every rank joins, even one that logged nothing: that is how the others learn it.
            try:
                values = self._across_ranks(names)
            except ConfigError:
                # Refused alike on every rank: the window is dropped everywhere, so a later
                # flush starts clean instead of failing on the same values again.
                self._sums.clear()
                self._counts.clear()
                raise
            if not names:
                return {}
        record: dict[str, float] = {"step": step, **dict(zip(names, values, strict=True))}
        if self.window is not None:
            # Measured on the host, read after the read-back: nothing more is read. A name
            # the program logged itself keeps its value.
            measured = self.window.close(step).items()
            record.update({k: v for k, v in measured if k not in record})
        self.history.append(record)
        self._sums.clear()
        self._counts.clear()
        if self.on_record is not None:
            self.on_record(record)
        return record

    def record(self, step: int, values: dict[str, torch.Tensor | float]) -> dict[str, float]:
        """Append ``values`` (computed by the program itself: a validation loss, an accuracy)
        to ``history`` as they are, stamped with ``step`` (the run's, or one the program gave,
        see :func:`checked_step`): no averaging over the ranks and no collective. A tensor is
        read back here (once per call: this is for values computed once in a while, not every
        step)."""
        if not values:
            raise ConfigError(
                "rt.log_metrics() got no metrics: pass them by name, e.g. "
                "rt.log_metrics(val_loss=val_loss)"
            )
        # A Python number is kept as it is (a float64); only a tensor is read back.
        kept = {
            name: float(v) if isinstance(v, numbers.Real) else float(_as_tensor(name, v))
            for name, v in values.items()
        }
        record: dict[str, float] = {"step": step, **dict(sorted(kept.items()))}
        self.history.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return record

    def _across_ranks(self, names: tuple[str, ...]) -> list[float]:
        kept = names[:CAPACITY]  # more is refused below, by every rank alike
        means = [self._sums[n].to(torch.float64) / self._counts[n] for n in kept]
        # float64: the checks' sums must be exact integers (below 2**53 for up to 2**18 ranks).
        padding = torch.zeros(CAPACITY - len(kept), dtype=torch.float64, device=self.device)
        vector = torch.cat([*(m.reshape(1) for m in means), padding, self._check(names)])
        summed = self.strategy.all_reduce(vector, "sum").tolist()  # the flush's one read
        ranks = self.strategy.world_size
        sums, squares = summed[CAPACITY : CAPACITY + _CHECKS], summed[CAPACITY + _CHECKS :]
        if any(ranks * sq != s * s for s, sq in zip(sums, squares, strict=True)):
            raise ConfigError(
                "rt.log got different metric names on different ranks: log the same names on "
                "every rank, the same number of times (values are averaged across ranks)"
            )
        if len(names) > CAPACITY:
            raise ConfigError(
                f"rt.log got {len(names)} different metric names between two flushes; at most "
                f"{CAPACITY} can be averaged over the ranks at once: log fewer names, or flush "
                "more often (a smaller log_every)"
            )
        return [v / ranks for v in summed[: len(names)]]

    def _check(self, names: tuple[str, ...]) -> torch.Tensor:
        """The count of ``names`` (at most 2**16, for exact squares), the bytes of their
        CRC-32, and the squares of those five, made on the device once per set of names."""
        if names not in self._checks:
            crc = zlib.crc32("\n".join(names).encode())
            ints = [min(len(names), 2**16), *crc.to_bytes(4, "little")]
            values = [float(i) for i in ints] + [float(i * i) for i in ints]
            self._checks[names] = torch.tensor(values, dtype=torch.float64).to(self.device)
        return self._checks[names]


def checked_step(step: object) -> int:
    """``step`` as ``rt.log_metrics(step=...)`` records it: a whole number, 0 or more (a NumPy
    integer too); anything else is refused here, at the call that gave it.

    >>> checked_step(3), checked_step(np.int64(4))
    (3, 4)
    """
    if isinstance(step, numbers.Integral) and not isinstance(step, (bool, np.bool_)):
        if int(step) >= 0:
            return int(step)
        shown = f"{step}, below 0"
    elif isinstance(step, torch.Tensor):
        shown = f"a tensor of shape {tuple(step.shape)}"
    else:
        shown = f"{safe_repr(step, 80)}, a {type_name(step)}"
    raise ConfigError(
        f"rt.log_metrics(step=...) got {shown}: give the step to record the values at, a whole "
        "number 0 or more (e.g. step=epoch, or step=int(t) for a tensor), or leave it out to "
        "record them at rt.global_step"
    )


def _as_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` as a one-element tensor to add to the sums: a real number (Python's or
    NumPy's; bools count as 0 and 1, so their mean is a fraction) or a one-element tensor that
    is not complex. Anything else is refused here, at the call that logged it.

    >>> _as_tensor("acc", True), _as_tensor("loss", torch.tensor([2.5]))
    (tensor(1.), tensor(2.5000))
    """
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_complex():  # a loss: every step's case, no view
            return value.detach()
        if value.numel() == 1 and not value.is_complex():
            return value.detach().reshape(())  # a [[x]] must stack with the other means
        shown = (
            f"a {value.dtype} tensor"
            if value.is_complex()
            else f"a tensor of shape {tuple(value.shape)}"
        )
    elif isinstance(value, (numbers.Real, np.bool_)):
        return torch.tensor(float(value))
    else:
        shown = f"{safe_repr(value, 80)}, a {type_name(value)}"
    raise ConfigError(
        f"rt.log({name}=...) got {shown}: log numbers (an int, a float, or a one-element real "
        f"tensor), e.g. rt.log({name}=loss) or the mean of what you measured, "
        f"rt.log({name}=values.mean())"
    )
