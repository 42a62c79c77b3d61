"""Real tensors where a computation needs values, under the planner's fake tensors.

The planner runs gpukit's own code over fake tensors (shapes without values). A few steps
need real values that come from the host, not from the model: a device mesh's coordinates,
the flags ranks exchange to agree on a verdict. Those run with fake tensors paused.

>>> import torch
>>> with real_tensors():
...     torch.ones(2).tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def real_tensors() -> Any:
    """A context in which new tensors are real even inside a fake tensor mode (else nothing)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - every supported torch has it
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def has_values(t: torch.Tensor) -> bool:
    """False for tensors without data: meta tensors, and the planner's fake tensors.

    >>> has_values(torch.ones(1)), has_values(torch.ones(1, device="meta"))
    (True, False)
    """
    if t.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - every supported torch has it
        return True
    return not is_fake(t)


def in_real_process_group() -> bool:
    """Whether this process is in a process group, other than the planner's fake one."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"
