"""How long the training steps waited for their batches: ``data_wait`` in ``rt.history``, when
the Runtime's ``data_wait`` setting asks (``gpukit train`` always does).

Measured over each logging window (what one record of ``rt.history`` covers), for the batches
the loaders ``rt.setup`` wrapped handed out in it; a window in which no such loader handed out
a batch gets none of these values:

- ``data_wait``: seconds the host spent blocked in the DataLoader's own ``next()`` (waiting for
  its workers, or running ``__getitem__`` and ``collate_fn`` in this process), summed over the
  window's batches (a pass that ends without a training step, an evaluation, is left out).
  ``time.perf_counter`` around the call: nothing is read from a device.
- ``data_wait_fraction``: ``data_wait`` over the window's wall time, from the first batch asked
  for in it to its read-back (the steps' time: what happens between windows, a checkpoint
  written, a validation pass, is not in it).
- On CUDA, the device's own wait as well: ``data_wait_device``, seconds the current stream
  waited for the batches' copies to the device (between two CUDA events recorded on it around
  that wait), and ``data_wait_device_fraction``, that over the device's time for the window
  (from the first of those events to one recorded just before the window's read-back). The
  events are read after that read-back, which waits for the device anyway, and only once
  ``query()`` says they are complete: no synchronisation is added (an event not complete yet
  is left for the next window).

Under several processes each rank records its own wait (it is not averaged over the ranks).

When, in a window after the first (the first holds the workers' start), the steps waited more
than 5% of the time (``data_wait_fraction``) and 0.1 s at least (less is too little to tell a
slow loader from the machine's noise), rank 0 warns once per run, naming the loader's settings
to change with their values (:func:`advice`).

>>> meter = DataWait(clock=iter([0.0, 0.5, 1.0, 1.25, 2.0]).__next__)
>>> batches = list(meter.timed(iter(["a"]), loader=None))  # one batch, then the end
>>> meter.before_read()
>>> meter.close(step=1)
{'data_wait': 0.75, 'data_wait_fraction': 0.375}
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpukit.errors import warn_user

# More waiting than this share of a window's time is worth a warning, when the window's waits
# add up to this many seconds at least: below that, a short window (a few fast steps at a
# pass's end) cannot tell a slow loader from the machine's noise.
WARN_ABOVE = 0.05
WARN_AT_LEAST = 0.1
# CUDA marks held before the completed ones are added up (without waiting for any).
_PENDING = 32


class DataWait:
    """The Runtime's meter of the time its steps waited for batches (see the module doc):
    the loaders add to it, ``Metrics`` closes a window at each read-back."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._first_ask: float | None = None  # when the window's first batch was asked for
        self._waited = 0.0
        self._by_loader: dict[int, tuple[Any, float]] = {}  # id -> (loader, seconds waited)
        # On CUDA: the window's first event, the device's wait added up from the marks that
        # completed, and the marks (asked, got) not yet seen complete.
        self._first_asked: torch.cuda.Event | None = None
        self._device_waited = 0.0
        self._marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._mark_device: torch.device | None = None
        self._end: torch.cuda.Event | None = None
        self._windows = 0  # windows closed with a wait in them
        self.warned = False

    # -- what the loaders tell ---------------------------------------------------------------
    def timed(self, batches: Iterator[Any], loader: Any) -> Iterator[Any]:
        """``batches`` as they are, each ``next()`` timed and counted for ``loader``."""
        clock = self.clock
        while True:
            start = clock()
            try:
                batch = next(batches)
            except StopIteration:  # asking for the end also waits (the last workers)
                self._add(loader, start, clock() - start)
                return
            self._add(loader, start, clock() - start)
            yield batch

    def _add(self, loader: Any, start: float, seconds: float) -> None:
        if self._first_ask is None:
            self._first_ask = start
        self._waited += seconds
        held = self._by_loader.get(id(loader))
        self._by_loader[id(loader)] = (loader, seconds + (held[1] if held else 0.0))

    def forget(self, loader: Any) -> None:
        """Leave out what ``loader`` waited in the open window: its pass ended without a
        training step (an evaluation, a peek). A window left with no other loader's batch
        starts again at the next batch asked for."""
        held = self._by_loader.pop(id(loader), None)
        if held is not None:
            self._waited -= held[1]
        if not self._by_loader:
            self._first_ask, self._waited = None, 0.0

    def device_marks(
        self, device: torch.device, asked: torch.cuda.Event, got: torch.cuda.Event
    ) -> None:
        """Two events recorded on ``device``'s current stream around its wait for a copy."""
        self._mark_device = device
        if self._first_asked is None:
            self._first_asked = asked
        self._marks.append((asked, got))
        if len(self._marks) > _PENDING:  # a loop that never flushes keeps few events alive
            self._fold()

    def _fold(self) -> bool:
        """Add up the waits of the marks that completed (``query()``: no waiting); True when
        none is left pending."""
        while self._marks and self._marks[0][1].query():
            asked, got = self._marks.pop(0)  # asked came before got on the stream: complete
            self._device_waited += asked.elapsed_time(got) / 1000
        return not self._marks

    # -- what the read-back of a window does -------------------------------------------------
    def before_read(self) -> None:
        """Just before a window's values are read back: on CUDA, the event that ends the
        device's time for the window (complete once the read-back has waited)."""
        if self._first_asked is not None and self._mark_device is not None:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record(torch.cuda.current_stream(self._mark_device))

    def close(self, step: int) -> dict[str, float]:
        """The window's values (none when no batch was asked for in it); starts the next."""
        if self._first_ask is None:
            return {}
        wall = self.clock() - self._first_ask
        fraction = self._waited / wall if wall > 0 else 0.0
        values = {"data_wait": self._waited, "data_wait_fraction": fraction}
        values.update(self._device_window())
        self._windows += 1
        slow = fraction > WARN_ABOVE and self._waited >= WARN_AT_LEAST
        if self._windows > 1 and slow and not self.warned:
            self.warned = True
            loader = max(self._by_loader.values(), key=lambda held: held[1])[0]
            warn_user(_message(fraction, step, loader))
        self._first_ask, self._waited = None, 0.0
        self._by_loader.clear()
        return values

    def _device_window(self) -> dict[str, float]:
        end, first = self._end, self._first_asked
        if end is None or first is None:
            return {}
        if not (self._fold() and end.query()):
            return {}  # not complete yet (another stream): read with the next window
        span = first.elapsed_time(end) / 1000
        waited, self._device_waited = self._device_waited, 0.0
        self._first_asked, self._end = None, None
        return {
            "data_wait_device": waited,
            "data_wait_device_fraction": waited / span if span > 0 else 0.0,
        }


def _message(fraction: float, step: int, loader: Any) -> str:
    settings = "; ".join(advice(loader)) if loader is not None else "its num_workers"
    return (
        f"the training steps waited {fraction:.0%} of their time for batches (data_wait_fraction "
        f"in rt.history, over the logging window up to step {step}; above "
        f"{WARN_ABOVE:.0%} the device idles while the DataLoader works). Change the "
        f"DataLoader's settings: {settings}"
    )


def advice(loader: Any, cpus: int | None = None) -> list[str]:
    """Each DataLoader setting that bears on waiting for batches, with its value and what to
    try: ``loader`` is the one ``rt.setup`` returned (a ``DeviceLoader``: its ``loader`` is
    the DataLoader it iterates, ``device`` where batches go); ``cpus``: this process's.

    >>> from torch.utils.data import DataLoader
    >>> advice(DataLoader(range(4)), cpus=8)
    ['num_workers=0: try 4']
    >>> advice(DataLoader(range(4), num_workers=2, prefetch_factor=2), cpus=8)
    ['num_workers=2: try 4',
     'persistent_workers=False: try True (workers start again every pass)',
     'prefetch_factor=2: try 4']
    """
    iterated = getattr(loader, "loader", loader)
    device = getattr(loader, "device", torch.device("cpu"))
    cpus = cpus or _cpus()
    workers = int(iterated.num_workers)
    out = []
    if workers == 0:
        out.append(f"num_workers=0: try {min(4, cpus)}" if cpus > 1 else "num_workers=0")
    elif workers < cpus:
        out.append(f"num_workers={workers}: try {min(2 * workers, cpus)}")
    else:
        out.append(
            f"num_workers={workers} (this machine has {cpus} CPUs: make the dataset's "
            "__getitem__ faster)"
        )
    if device.type == "cuda":
        pinned = bool(iterated.pin_memory)
        out.append("pin_memory=True" if pinned else "pin_memory=False: try True")
    if workers > 0:
        if not iterated.persistent_workers:
            out.append("persistent_workers=False: try True (workers start again every pass)")
        factor = iterated.prefetch_factor
        out.append(f"prefetch_factor={factor}: try {2 * factor}")
    return out


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
