"""Metrics kept on the device and read back once per flush.

``log(step, loss=loss)`` keeps each value where it is, on the device: no read-back, so the GPU
never waits for the host, and no device work either. Every ``log_every`` calls (and on
``flush``) the means are read back once and appended to ``history``.

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
[{'step': 1.0, 'loss': 2.0}]
"""

from __future__ import annotations

import contextlib
import zlib

import torch

from gpukit.errors import ConfigError
from gpukit.strategies import Strategy

# Names one flush can carry under several processes (the all-reduce has a fixed length).
CAPACITY = 256
_CHECKS = 5  # the count of names and the four bytes of their CRC-32


class Metrics:
    """Running sums of logged values on ``device``, read back every ``log_every`` calls."""

    def __init__(self, device: torch.device, log_every: int, strategy: Strategy) -> None:
        self.device = device
        self.log_every = log_every
        self.strategy = strategy
        self.history: list[dict[str, float]] = []
        self._values: dict[str, list[torch.Tensor | float]] = {}  # logged since the flush
        self._calls = 0
        self._checks: dict[tuple[str, ...], torch.Tensor] = {}  # names -> their check, on device

    def log(self, step: int, metrics: dict[str, torch.Tensor | float]) -> None:
        """Keep ``metrics`` for the next flush; flush every ``log_every`` calls (``step``: the
        optimizer step the flushed record is stamped with)."""
        if not metrics:
            raise ConfigError("rt.log() got no metrics: pass them by name, e.g. rt.log(loss=loss)")
        # Kept as given (detached): no device work and no copy here, on every step; the flush
        # moves and adds them all at once. This runs every step, so it stays this short.
        values = self._values
        for name, value in metrics.items():
            kept = values.get(name)
            if kept is None:
                kept = values[name] = []
            if isinstance(value, torch.Tensor):
                # Detached so that no graph is kept until the flush (train_step's loss already is).
                kept.append(value.detach() if value.requires_grad else value)
            else:
                kept.append(float(value))
        self._calls += 1
        if self._calls % self.log_every == 0:
            self.flush(step)

    def flush(self, step: int) -> dict[str, float]:
        """Read back the means of what was logged since the last flush (one read; under several
        processes every rank must call it together), and append them to ``history``."""
        names = tuple(sorted(self._values))
        if not names:
            return {}
        means = torch.stack([self._mean(self._values[n]) for n in names])
        values = self._across_ranks(names, means) if self.strategy.distributed else means.tolist()
        record = {"step": float(step), **dict(zip(names, values, strict=True))}
        self.history.append(record)
        self._values.clear()
        return record

    def _mean(self, kept: list[torch.Tensor | float]) -> torch.Tensor:
        """The mean of one metric's values, in float32 on the device."""
        if all(isinstance(v, float) for v in kept):
            return torch.tensor(sum(kept) / len(kept), dtype=torch.float32).to(self.device)
        with contextlib.suppress(TypeError, RuntimeError):  # floats among them, or devices
            return torch.stack(kept).to(self.device, torch.float32).mean(0)  # type: ignore[arg-type]
        parts = [
            v.to(self.device, torch.float32)
            if isinstance(v, torch.Tensor)
            else torch.tensor(v, dtype=torch.float32).to(self.device)
            for v in kept
        ]
        return torch.stack(parts).mean(0)

    def _across_ranks(self, names: tuple[str, ...], means: torch.Tensor) -> list[float]:
        if len(names) > CAPACITY:
            raise ConfigError(
                f"rt.log got {len(names)} different metric names between two flushes; at most "
                f"{CAPACITY} can be averaged over the ranks at once: log fewer names, or flush "
                "more often (a smaller log_every)"
            )
        # float64: the checks' sums must be exact integers (below 2**53 for up to 2**18 ranks).
        padding = torch.zeros(CAPACITY - len(names), dtype=torch.float64, device=self.device)
        vector = torch.cat([means.to(torch.float64), padding, self._check(names)])
        summed = self.strategy.all_reduce(vector, "sum").tolist()  # the flush's one read
        ranks = self.strategy.world_size
        sums, squares = summed[CAPACITY : CAPACITY + _CHECKS], summed[CAPACITY + _CHECKS :]
        if any(ranks * sq != s * s for s, sq in zip(sums, squares, strict=True)):
            raise ConfigError(
                "rt.log got different metric names on different ranks: log the same names on "
                "every rank, the same number of times (values are averaged across ranks)"
            )
        return [v / ranks for v in summed[: len(names)]]

    def _check(self, names: tuple[str, ...]) -> torch.Tensor:
        """The count of ``names``, the bytes of their CRC-32, and the squares of those five,
        made on the device once per set of names."""
        if names not in self._checks:
            crc = zlib.crc32("\n".join(names).encode())
            ints = [len(names), *crc.to_bytes(4, "little")]
            values = [float(i) for i in ints] + [float(i * i) for i in ints]
            self._checks[names] = torch.tensor(values, dtype=torch.float64).to(self.device)
        return self._checks[names]
