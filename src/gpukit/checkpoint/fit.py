"""Whether what a checkpoint holds fits the live models, optimizers and precision, checked
before anything is changed, so that a load either restores everything or nothing.

Each function returns a line per mismatch (empty: it fits).

>>> import torch
>>> model_mismatches({"weight": torch.zeros(4, 2), "bias": torch.zeros(4)}, torch.nn.Linear(2, 3))
['weight: checkpoint (4, 2), model (3, 2)', 'bias: checkpoint (4,), model (3,)']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit.checkpoint import finite
from gpukit.checkpoint.live import Precision, RunState, Unwraps, user_model


def user_models(state: RunState, strategy: Unwraps, precision: Unwraps) -> list[nn.Module]:
    """The user's own models inside what setup returned: their keys are the checkpoint's."""
    return [user_model(m, strategy, precision) for m in state.modules]


def weights_name(index: int, count: int) -> str:
    """The weights file of model ``index`` out of ``count``."""
    return "model.safetensors" if count == 1 else f"model-{index}.safetensors"


def model_mismatches(saved: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    """Keys, shapes and dtypes of the saved weights against ``model.state_dict()``."""
    live = model.state_dict()
    found: list[str] = []
    for key, value in live.items():
        kept = saved.get(key)
        if kept is None:
            if not _tied_to_saved(key, live, saved):
                found.append(f"{key}: not in the checkpoint, model {_shape(value)}")
        elif kept.shape != value.shape:
            found.append(f"{key}: checkpoint {_shape(kept)}, model {_shape(value)}")
        elif kept.dtype != value.dtype:
            found.append(f"{key}: checkpoint {kept.dtype}, model {value.dtype}")
    found += [
        f"{k}: checkpoint {_shape(v)}, not in the model" for k, v in saved.items() if k not in live
    ]
    return found


def optimizer_mismatches(
    saved: Any, optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> list[str]:
    """Parameter groups, their sizes, and each state tensor's shape against the live
    optimizer's parameters (``names``: a parameter's id to its name, for the messages)."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        return ["not an optimizer's state_dict (no 'state' and 'param_groups')"]
    groups, live_groups = saved["param_groups"], optimizer.param_groups
    if len(groups) != len(live_groups):
        return [f"{len(groups)} parameter group(s) in the checkpoint, {len(live_groups)} now"]
    found: list[str] = []
    params: dict[Any, nn.Parameter] = {}
    for g, (group, live_group) in enumerate(zip(groups, live_groups, strict=True)):
        ids, live = group.get("params", []), live_group["params"]
        if len(ids) != len(live):
            found.append(f"group {g}: {len(ids)} parameter(s) in the checkpoint, {len(live)} now")
        params.update(zip(ids, live, strict=False))
    if found:
        return found
    for index, entries in saved["state"].items():
        param = params.get(index)
        if param is None:
            found.append(f"state of parameter {index}, which no parameter group holds")
            continue
        name = f"{names.get(id(param), f'parameter {index}')} {_shape(param)}"
        if not isinstance(entries, dict):
            found.append(f"{name}: its state is a {type(entries).__name__}, not a dict")
            continue
        live_entries = optimizer.state.get(param, {})
        for key, value in entries.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            now = live_entries.get(key)
            if isinstance(now, torch.Tensor) and now.shape != value.shape:
                found.append(f"{name}: {key} checkpoint {_shape(value)}, optimizer {_shape(now)}")
            elif not _fits(value.shape, param.shape):
                found.append(f"{name}: {key} has shape {_shape(value)} in the checkpoint")
    return found


def precision_mismatches(saved: Any, precision: Precision) -> list[str]:
    """The saved precision state against what ``precision.load_state_dict`` needs: each part
    the live precision has (its gradient scaler) must hold every setting it holds."""
    if not isinstance(saved, dict):
        return [f"precision state is a {type(saved).__name__}, not a dict"]
    found: list[str] = []
    for part, now in precision.state_dict().items():
        kept = saved.get(part)
        if kept is None or not isinstance(now, dict) or not now:
            continue  # a part saved without it (or not kept now) is left as it is
        missing = sorted(set(now) - set(kept)) if isinstance(kept, dict) else sorted(now)
        if missing:
            found.append(f"precision {part}: the checkpoint lacks {', '.join(map(str, missing))}")
    return found


def parameter_names(models: list[nn.Module]) -> dict[int, str]:
    """Each parameter's id to its name in its model (``model 1: fc.weight`` for several)."""
    names: dict[int, str] = {}
    for i, model in enumerate(models):
        prefix = f"model {i}: " if len(models) > 1 else ""
        for name, param in model.named_parameters():
            names.setdefault(id(param), prefix + name)
    return names


def optimizer_entries(
    file: str,
    label: str,
    saved: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    names: dict[int, str],
) -> list[finite.Entry]:
    """Every tensor and number of a saved optimizer state (one that fits ``optimizer``), named
    by its parameter: ``optimizer 0 exp_avg of fc.weight``."""
    live = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [index for group in saved["param_groups"] for index in group["params"]]
    which = {
        index: names.get(id(p), f"parameter {index}") for index, p in zip(ids, live, strict=True)
    }
    entries: list[finite.Entry] = []
    for index, kept in saved["state"].items():
        for key, value in kept.items():
            name = f"{label} {key} of {which.get(index, f'parameter {index}')}"
            entries += finite.state_entries(file, name, value)
    return entries


def _tied_to_saved(key: str, live: dict[str, torch.Tensor], saved: dict[str, Any]) -> bool:
    """Whether ``key`` shares its memory with a saved key (a tied weight, which the weights
    file keeps once, under one of its names)."""
    value = live[key]
    return any(
        other in saved
        and other != key
        and t.shape == value.shape
        and t.storage_offset() == value.storage_offset()
        and t.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        for other, t in live.items()
    )


def _fits(state: torch.Size, param: torch.Size) -> bool:
    """A state tensor fits a parameter when it has its shape or broadcasts to it (factored
    states, such as Adafactor's row and column statistics)."""
    try:
        return torch.broadcast_shapes(state, param) == param
    except RuntimeError:
        return False


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)
