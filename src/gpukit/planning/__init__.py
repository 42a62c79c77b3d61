"""The capacity planner: each device's peak memory and the step time, per strategy and device
count, predicted before a run (``gk.plan``, ``gpukit plan``). It counts with the live-tensor counter
of :mod:`gpukit.diagnostics.live_tensors`, the one ``gpukit train`` measures with.

Layouts of ``dp_replicate x dp_shard x tp x pp x cp`` are planned in closed form from a
decoder's sizes (:mod:`gpukit.planning.layout_search`); :func:`choose_layout` is what a run's
``parallel="auto"`` asks: ``choose_layout(model, world_size, "h100") -> (degrees, reason)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["choose_layout"]


def __getattr__(name: str) -> Any:
    # Imported when asked: the planner's modules reach the runtime's settings, which a
    # strategy importing one of this package's modules must not load.
    if name == "choose_layout":
        from gpukit.planning.layout_search import choose_layout

        return choose_layout
    raise AttributeError(f"module 'gpukit.planning' has no attribute {name!r}")
