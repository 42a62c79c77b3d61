"""``rt.progress(loader)``: the program's own loop, with progress shown on rank 0.

>>> import io, torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu", log_every=2)
>>> loader = rt.setup_loader(DataLoader(TensorDataset(torch.ones(8, 2)), batch_size=2))
>>> out = io.StringIO()
>>> for (x,) in rt.progress(loader, every=0, out=out):
...     rt.log(loss=x.sum())
>>> out.getvalue().splitlines()[-1].split(", ")[:3]
['train 4/4 batches (100%)', 'epoch 1', 'loss 4.0000']
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import IO, Generic, TypeVar

from rich.console import Console

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.runtime.outputs.progress_displays import (
    DEFAULT_EVERY,
    Bar,
    History,
    ProgressLines,
    Quiet,
    shows_bar,
)
from gpukit.strategies import Strategy

T = TypeVar("T")


def clock() -> float:
    """Seconds for the rate and the time left (a test's seam: replace it with a fake clock)."""
    return time.monotonic()


class Progress:
    """The Runtime's ``rt.progress``: shown on rank 0 of ``strategy``'s ranks (the Runtime
    gives it the new one when ``strategy="auto"`` replaces it), with the last values of
    ``history`` (``rt.history``, read as it grows)."""

    def __init__(self, strategy: Strategy, history: History) -> None:
        self.strategy, self.history = strategy, history

    def progress(
        self,
        iterable: Iterable[T],
        *,
        total: int | None = None,
        desc: str = "train",
        every: float = DEFAULT_EVERY,
        epochs: int | None = None,
        out: IO[str] | Console | None = None,
    ) -> Shown[T]:
        """``iterable`` (a loader, any iterable) as it is, with its progress shown on rank 0:
        a rich bar on a terminal or in a notebook, else (CI logs, ``| tee``, files) a plain
        line every ``every`` seconds (0: after every batch) and at the end. Shown: batches done
        of ``total`` (default ``len(iterable)``; without it, no time left is shown), the epoch
        (the loader's pass, when it is one ``rt.setup`` returned; ``epochs``: how many there
        are), the last loss ``rt.log`` read back (``rt.history``: the display reads nothing
        from the device), samples/s (batches/s when the loader's batch size is unknown) and
        the time left. Other ranks iterate without showing anything. ``out``: the stream or
        rich Console to show it on (default: stdout).

        >>> import io, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> [b for b in rt.progress(range(3), desc="eval", out=io.StringIO())]
        [0, 1, 2]
        """
        _check(total, every, epochs)
        if self.strategy.rank != 0:
            return Shown(iterable, total, None)
        console = out if isinstance(out, Console) else Console(file=out)
        display = _Display(console, desc, every, epochs, self.strategy.world_size, self.history)
        return Shown(iterable, total, display)


class _Display:
    """What rank 0 needs to make a display when a pass starts."""

    def __init__(
        self,
        console: Console,
        desc: str,
        every: float,
        epochs: int | None,
        world_size: int,
        history: History,
    ) -> None:
        self.console, self.desc, self.every, self.epochs = console, desc, every, epochs
        self.world_size, self.history = world_size, history

    def make(self, total: int | None, batch_size: int | None, first: int) -> Quiet:
        # Samples per batch over all ranks: each rank's loader hands out its own batches.
        samples = batch_size * self.world_size if batch_size is not None else None
        if shows_bar(self.console):
            return Bar(
                total,
                samples,
                first,
                desc=self.desc,
                unit="batches",
                show_epoch=True,
                console=self.console,
            )
        return ProgressLines(
            total,
            self.epochs,
            samples,
            first,
            self.every,
            clock=lambda: clock(),
            out=self.console.file,
            desc=self.desc,
            unit="batches",
        )


class Shown(Generic[T]):
    """What ``rt.progress`` returns: iterate it as the iterable it wraps (again for each pass
    of a loader); ``len()`` is the total when known."""

    def __init__(self, iterable: Iterable[T], total: int | None, display: _Display | None):
        self.iterable, self.total, self.display = iterable, total, display

    def __len__(self) -> int:
        total = self._total()
        if total is None:
            raise TypeError(f"{described(self.iterable)} has no len(): pass total=")
        return total

    def _total(self) -> int | None:
        if self.total is not None:
            return self.total
        try:
            return len(self.iterable)  # type: ignore[arg-type]  # TypeError: no length
        except TypeError:  # an iterable dataset's loader, a generator
            return None

    def __iter__(self) -> Iterator[T]:
        if self.display is None:  # not rank 0: nothing shown, nothing added
            return iter(self.iterable)
        return self._shown(self.display)

    def _shown(self, display: _Display) -> Iterator[T]:
        batches = iter(self.iterable)
        # Read once the pass has started: a loader from rt.setup has then counted the pass left
        # early before it and knows the batches a resumed pass skips.
        epoch = getattr(self.iterable, "epoch", None)
        first = getattr(self.iterable, "position", 0)
        first = first if isinstance(first, int) else 0
        batch_size = getattr(self.iterable, "batch_size", None)
        shown = display.make(
            self._total(), batch_size if isinstance(batch_size, int) else None, first
        )
        step, history = first, display.history
        with shown:
            shown.epoch_start(epoch + 1 if isinstance(epoch, int) else None, step, history)
            try:
                for item in batches:
                    yield item
                    step += 1
                    shown.advance(step, history)
            finally:
                # Also when the loop breaks early; the pass's end has read back its last window.
                shown.finish(step, history)


def _check(total: object, every: object, epochs: object) -> None:
    # total=0 is an empty loader's length; epochs=0 would show "epoch 1/0" over a run that
    # has an epoch, so epochs counts from 1.
    for name, value, least in (("total", total, 0), ("epochs", epochs, 1)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < least
        ):
            raise ConfigError(
                f"rt.progress({name}={described(value)}): give a whole number, {least} or "
                "more, or None (total: len() of the iterable; epochs: how many passes the "
                "loop makes, None: not shown)"
            )
    number = isinstance(every, (int, float)) and not isinstance(every, bool)
    if not (number and every >= 0):  # type: ignore[operator]  # also refuses NaN
        raise ConfigError(
            f"rt.progress(every={described(every)}): give the seconds between progress lines, "
            "0 or more (0: a line after every batch)"
        )
