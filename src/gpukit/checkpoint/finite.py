"""Non-finite values (NaN, Inf) in what a checkpoint holds, named tensor by tensor.

Runs only inside a save or a load, never in a training step. One reduction per tensor and one
read-back per device find the suspects; only those are counted exactly.

>>> import torch
>>> problems([("model.safetensors", "fc.weight", torch.tensor([1.0, float("nan")]), False)])
['model.safetensors: fc.weight has 1 NaN']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from gpukit._util.tree import children

# (file, name, value, NaN only): buffers may hold infinities on purpose (an attention mask of
# -inf), so only NaN counts against them.
Entry = tuple[str, str, Any, bool]
_EXACT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def problems(entries: Iterable[Entry]) -> list[str]:
    """One line per tensor or number holding NaN (or, unless NaN only, Inf)."""
    found: list[str] = []
    suspects: dict[torch.device, list[tuple[Entry, torch.Tensor]]] = {}
    for entry in entries:
        file, name, value, nan_only = entry
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not value.is_meta and value.numel():
                suspects.setdefault(value.device, []).append((entry, _sum(value)))
        elif isinstance(value, float) and (
            math.isnan(value) or (math.isinf(value) and not nan_only)
        ):
            found.append(f"{file}: {name} is {value}")
    for listed in suspects.values():
        # A sum is finite exactly when every value is, up to overflow, which the count below
        # rules out: one read-back for all the tensors of a device.
        finite = torch.isfinite(torch.stack([s for _, s in listed])).tolist()
        for ((file, name, value, nan_only), _), ok in zip(listed, finite, strict=True):
            if not ok and (line := _count(value, nan_only)):
                found.append(f"{file}: {name} has {line}")
    return found


def model_entries(file: str, tensors: dict[str, torch.Tensor], model: nn.Module) -> list[Entry]:
    """The weights of ``model`` as saved in ``file`` (``tensors``: name to tensor)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [(file, key, value, key not in parameters) for key, value in tensors.items()]


def state_entries(file: str, label: str, state: Any) -> Iterator[Entry]:
    """Every tensor and float inside a nested state (an optimizer's, a scaler's)."""
    if isinstance(state, (torch.Tensor, float)):
        yield file, label, state, False
        return
    for name, value in children(state):
        yield from state_entries(file, f"{label}{name}", value)


def _sum(t: torch.Tensor) -> torch.Tensor:
    value = t.detach()
    if value.dtype not in _EXACT:  # float8 and the like have no reductions of their own
        value = value.float()
    # float64 cannot overflow summing float32 values; MPS has no float64.
    wide = torch.float32 if value.device.type == "mps" else torch.float64
    return value.sum(dtype=wide)


def _count(t: torch.Tensor, nan_only: bool) -> str:
    value = t.detach()
    if value.dtype not in _EXACT:
        value = value.float()
    nan = int(value.isnan().sum())
    inf = 0 if nan_only else int(value.isinf().sum())
    parts = [f"{nan} NaN"] * bool(nan) + [f"{inf} Inf"] * bool(inf)
    return " and ".join(parts)
