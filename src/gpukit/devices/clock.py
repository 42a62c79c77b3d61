"""One timed run on a device: the clock read only once the device's queued work is done.

A GPU returns from a launch before its work is finished, so a host clock read without waiting
times the launches, not the work. The planner's calibration and every ``gpukit bench``
experiment time through these two functions, so they measure alike.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch


def time_once(run: Callable[[], object], synchronize: Callable[[], None] | None = None) -> float:
    """Seconds ``run()`` takes, the garbage collector off and the device synchronised before
    each clock read.

    >>> time_once(lambda: None) >= 0
    True
    """
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        if synchronize is not None:
            synchronize()
        start = time.perf_counter()
        run()
        if synchronize is not None:
            synchronize()
        return time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()


def synchronizer(device: torch.device | str) -> Callable[[], None] | None:
    """What waits for ``device``'s queued work: None on the CPU, where every op has finished
    when it returns.

    >>> synchronizer("cpu") is None
    True
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    if dev.type == "mps":
        return torch.mps.synchronize
    return None
