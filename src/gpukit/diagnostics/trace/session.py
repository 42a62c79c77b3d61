"""``gk.trace()``: the :class:`Trace` a user enters and reads, and :func:`untraced`.

Entering a trace starts what records (the dispatch mode, the wrapped entry points) for its
:class:`~.records.Recorder`; reading one asks that recorder. This module sits on top: it
imports the others, none imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from gpukit.diagnostics.trace.dispatch import TraceMode
from gpukit.diagnostics.trace.entries import patched
from gpukit.diagnostics.trace.records import Recorder, Sync, Transfer, state
from gpukit.diagnostics.trace.report import render
from gpukit.errors import ConfigError


class Trace:
    """What :func:`trace` recorded. Entering it again adds to the same counts."""

    def __init__(self) -> None:
        self._recorder = Recorder()
        self._active: contextlib.ExitStack | None = None
        self._outer: Recorder | None = None  # the recorder of the trace this one is inside

    @property
    def transfers(self) -> list[Transfer]:
        """One per (kind, source line, pinned, blocking, devices), in order of first use."""
        return self._recorder.transfers

    @property
    def syncs(self) -> list[Sync]:
        """One per (op, source line, device), in order of first use. Reads of CPU tensors are
        kept as potential synchronisations only while no op ran on an accelerator: on a GPU
        run they are what they are, host work."""
        return self._recorder.syncs

    @property
    def ops_per_device(self) -> dict[str, int]:
        """Aten ops run per device: that of the op's first tensor argument, else its output."""
        return self._recorder.ops_per_device

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"transfers": [Transfer fields], "syncs": [Sync fields],
        "ops_per_device": {device: ops}}``."""
        transfers, syncs = self.transfers, self.syncs
        return {
            "transfers": [asdict(t) for t in transfers],
            "syncs": [asdict(s) for s in syncs],
            "ops_per_device": self.ops_per_device,
        }

    def report(self) -> str:
        """The findings ranked by estimated cost on a GPU, each with its line and a fix.

        Estimates rank, they do not predict: a synchronisation costs ``SYNC_S`` (30 us: the
        10-50 us round trip, while the GPU idles until the host queues work again); a copy
        ``COPY_LAUNCH_S`` (10 us) plus its bytes at 12 GB/s from pageable host memory, 25 GB/s
        from pinned, 50 GB/s between devices, plus ``SYNC_S`` if it is a blocking d2h copy
        (listed once, as a transfer, though ``syncs`` also has it as ``d2h-copy``). Where
        ``gpukit bench transfer`` measured this machine's GPU (the one the trace saw, else the
        first one once CUDA has started), its latencies and speeds replace these rough ones;
        the report's second line says which it used, and when they were measured.

        >>> print(Trace().report())
        gk.trace: 0 ops; no host<->device copies or synchronisations found
        """
        return render(self.ops_per_device, self.transfers, self.syncs)

    def __enter__(self) -> Trace:
        if self._active is not None or self._outer is not None:
            raise ConfigError("this gk.trace() is already active: enter a new gk.trace()")
        outer = state.recorder
        if outer is not None:
            # Inside another trace (a script traced by `gpukit trace` that traces a part of
            # itself): both see what happens here, through the outer trace's mode.
            self._outer = outer
            outer.inner.append(self._recorder)
            return self
        with contextlib.ExitStack() as stack:  # undoes the patches if the mode fails to start
            stack.enter_context(patched())
            stack.enter_context(TraceMode(self._recorder))
            self._active = stack.pop_all()
        state.recorder = self._recorder
        return self

    def __exit__(self, *exc: object) -> None:
        outer, self._outer = self._outer, None
        if outer is not None:
            outer.inner.remove(self._recorder)
            return
        active, self._active = self._active, None
        if active is not None:
            state.recorder = None
            active.close()


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Record nothing of what runs inside (gpukit's own one-time reads), in this thread.

    >>> import torch
    >>> with trace() as t:
    ...     with untraced():
    ...         _ = torch.ones(1).item()
    >>> t.syncs
    []
    """
    busy, state.busy = state.busy, True
    try:
        yield
    finally:
        state.busy = busy


def trace() -> Trace:
    """Record host<->device copies and synchronisations in this thread while the block runs.

    >>> import torch
    >>> with trace() as t:
    ...     print(torch.zeros(2))
    tensor([0., 0.])
    >>> [(s.op, s.count) for s in t.syncs]
    [('print', 1)]
    """
    return Trace()
