"""How a loop's progress is shown on rank 0: a rich bar on a terminal or in a notebook
(:class:`Bar`), plain lines every so many seconds elsewhere (:class:`ProgressLines`: CI logs,
``| tee``, files), or nothing (:class:`Quiet`: other ranks, progress turned off).

Every display is told the same things by the loop that drives it (``gpukit train``'s loop,
``rt.progress``): an epoch starts, a step ends, an epoch ends, the run ends; each with the
step and what ``rt.log`` has read back so far (``history``). A display shows the last loss
found there and never reads a tensor itself: showing progress costs the device nothing.

>>> import io
>>> out = io.StringIO()
>>> with ProgressLines(total=2, epochs=None, global_batch=None, first_step=0, every=0,
...                    out=out, desc="eval", unit="batches") as shown:
...     shown.advance(1, [{"step": 1, "loss": 0.5}])
>>> out.getvalue().split(", ")[:2]
['eval 1/2 batches (50%)', 'loss 0.5000']
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

# Seconds between progress lines when output is not a terminal: often enough to see a run is
# alive in a CI log, rarely enough not to flood it.
DEFAULT_EVERY = 30.0

History = list[dict[str, float]]


def last_loss(history: History) -> float | None:
    """The newest ``loss`` in ``history`` (what ``rt.log`` read back), None before any."""
    return next((r["loss"] for r in reversed(history) if "loss" in r), None)


def _shown_loss(loss: float | None) -> str:
    return f"{loss:.4f}" if loss is not None else "-"  # "-": nothing read back yet


class Quiet:
    """No progress shown: ranks other than 0, or progress turned off. The base of the
    displays: each hook gets the step and what ``rt.log`` has read back so far."""

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing was opened, so nothing closes."""

    def epoch_start(self, epoch: int | None, step: int, history: History) -> None:
        """Epoch ``epoch`` (None: not known) starts at ``step``."""

    def advance(self, step: int, history: History) -> None:
        """Step ``step`` ended."""

    def epoch_end(self, step: int, history: History) -> None:
        """An epoch ended at ``step``."""

    def finish(self, step: int, history: History) -> None:
        """The run ended at ``step``; ``history`` holds its last read-back."""


class Bar(Quiet):
    """rich's progress bar, redrawn in place: on a terminal, or in a notebook. ``total``
    None: a bar without an end (no time left shown). ``global_batch``: samples per step
    (None: the rate is in ``unit`` per second). ``show_epoch``: the epoch follows ``desc``.

    >>> import io
    >>> from rich.console import Console
    >>> console = Console(file=io.StringIO(), force_terminal=True, width=100)
    >>> with Bar(4, None, 0, desc="eval", unit="batches", console=console) as bar:
    ...     bar.advance(4, [])
    >>> "4/4 batches" in console.file.getvalue()
    True
    """

    def __init__(
        self,
        total: int | None,
        global_batch: int | None,
        first_step: int,
        *,
        desc: str = "train",
        unit: str = "steps",
        show_epoch: bool = False,
        console: Console | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total, self.global_batch, self.first_step = total, global_batch, first_step
        self.desc, self.unit, self.show_epoch, self.clock = desc, unit, show_epoch, clock
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]}"),
            TimeRemainingColumn(),
            console=console,
        )
        self.task = self.progress.add_task(
            desc, total=total, completed=first_step, count="", loss="-", rate=""
        )
        self.start = self.clock()
        self._update(first_step, [])

    def __enter__(self) -> Bar:
        self.progress.start()
        self.start = self.clock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def epoch_start(self, epoch: int | None, step: int, history: History) -> None:
        if self.show_epoch and epoch is not None:
            self.progress.update(self.task, description=f"{self.desc} epoch {epoch}")
        self.advance(step, history)

    def advance(self, step: int, history: History) -> None:
        self._update(step, history)

    def epoch_end(self, step: int, history: History) -> None:
        self.advance(step, history)

    def finish(self, step: int, history: History) -> None:
        self.advance(step, history)

    def _update(self, step: int, history: History) -> None:
        elapsed = self.clock() - self.start
        per_s = (step - self.first_step) / elapsed if elapsed > 0 else 0.0
        if self.global_batch is not None:
            rate = f"{per_s * self.global_batch:.0f} samples/s"
        else:
            rate = f"{per_s:.1f} {self.unit}/s"
        count = f"{step} {self.unit}" if self.total is None else f"{step}/{self.total} {self.unit}"
        shown = _shown_loss(last_loss(history))
        self.progress.update(self.task, completed=step, count=count, loss=shown, rate=rate)


class ProgressLines(Quiet):
    """Progress as plain lines, for output that is not a terminal (CI logs, pipes, files),
    where a redrawn bar would be lost or come out as control characters: a line at the start
    and end of each epoch, at the end, and after a step when ``every`` seconds have passed
    since the last line (0: after every step). Each line: steps (of ``total``, when known),
    the epoch (of ``epochs``, when known), the last loss read back, samples/s (``unit``/s
    when ``global_batch``, the samples of a step, is None) and the time left, from ``clock``
    (seconds).

    >>> clock = iter([0.0, 0.0, 10.0, 31.0, 40.0]).__next__
    >>> lines = ProgressLines(total=4, epochs=1, global_batch=8, first_step=0, every=30,
    ...                       clock=clock, out=sys.stdout)
    >>> with lines:
    ...     lines.epoch_start(1, 0, [])
    ...     lines.advance(1, [])                              # 10 s: too soon for a line
    ...     lines.advance(2, [{"step": 2.0, "loss": 0.5}])    # 31 s
    ...     lines.finish(4, [{"step": 4.0, "loss": 0.25}])    # 40 s
    train 0/4 steps (0%), epoch 1/1, loss -, - samples/s, ETA -
    train 2/4 steps (50%), epoch 1/1, loss 0.5000, 1 samples/s, ETA 0:00:31
    train 4/4 steps (100%), epoch 1/1, loss 0.2500, 1 samples/s, ETA 0:00:00
    """

    def __init__(
        self,
        total: int | None,
        epochs: int | None,
        global_batch: int | None,
        first_step: int,
        every: float,
        clock: Callable[[], float] = time.monotonic,
        out: IO[str] | None = None,
        *,
        desc: str = "train",
        unit: str = "steps",
    ) -> None:
        self.total, self.epochs, self.every = total, epochs, every
        self.global_batch, self.first_step = global_batch, first_step
        self.clock, self.out = clock, out
        self.desc, self.unit = desc, unit
        # The epoch shown: 1 when the loop says nothing of epochs but their number is known.
        self.epoch: int | None = 1 if epochs is not None else None
        self.start = self.last_time = 0.0
        self.last_shown: tuple[int, float | None] | None = None  # (step, loss) of the last line

    def __enter__(self) -> ProgressLines:
        self.start = self.last_time = self.clock()
        return self

    def epoch_start(self, epoch: int | None, step: int, history: History) -> None:
        self.epoch = epoch
        self._line(step, history, self.clock())

    def advance(self, step: int, history: History) -> None:
        now = self.clock()
        if now - self.last_time >= self.every:
            self._line(step, history, now)

    def epoch_end(self, step: int, history: History) -> None:
        if (step, last_loss(history)) != self.last_shown:  # not the line just printed again
            self._line(step, history, self.clock())

    def finish(self, step: int, history: History) -> None:
        self.epoch_end(step, history)

    def _line(self, step: int, history: History, now: float) -> None:
        loss = last_loss(history)
        done, elapsed = step - self.first_step, now - self.start
        rate = eta = "-"
        if done > 0 and elapsed > 0:
            if self.global_batch is not None:
                rate = f"{done * self.global_batch / elapsed:.0f}"
            else:
                rate = f"{done / elapsed:.1f}"
            if self.total:
                left = max(self.total - step, 0) * elapsed / done
                eta = str(datetime.timedelta(seconds=round(left)))
        if self.total:
            count = f"{step}/{self.total} {self.unit} ({step / self.total:.0%})"
        else:
            count = f"{step} {self.unit}"
        parts = [f"{self.desc} {count}"]
        if self.epoch is not None:
            of = f"/{self.epochs}" if self.epochs is not None else ""
            parts.append(f"epoch {self.epoch}{of}")
        rate_unit = "samples" if self.global_batch is not None else self.unit
        parts += [f"loss {_shown_loss(loss)}", f"{rate} {rate_unit}/s", f"ETA {eta}"]
        print(", ".join(parts), file=self.out or sys.stdout, flush=True)
        self.last_time, self.last_shown = now, (step, loss)


def shows_bar(console: Console) -> bool:
    """Whether ``console`` redraws a bar in place (a terminal or a notebook); else lines."""
    return bool(console.is_terminal or console.is_jupyter)
