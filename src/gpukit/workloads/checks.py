"""What a workload's parts must be to train: a model with trainable weights, a dataset of
(input, target) pairs the loader can stack, a loss function; each problem told with its fix."""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch
from torch import nn

from gpukit._util.text import described, safe_repr, type_name
from gpukit._util.tree import children
from gpukit.errors import ConfigError
from gpukit.workloads.user_functions import first_line


def check_parts(
    *, name: str, model: object, dataset: object, validation: object, loss: object, meta: bool
) -> None:
    """Refuse, before any process starts, a workload that cannot train: a model with nothing
    to train, a dataset that is empty or whose items are not (input, target) pairs."""
    problem = _model_problem(model, meta) or _dataset_problem(dataset)
    if problem is None and validation is not None:
        found = _dataset_problem(validation)
        problem = f"its validation set: {found}" if found else None
    if problem is None and not callable(loss):
        problem = f"the loss is {described(loss)}, not a function loss(output, target)"
    if problem is not None:
        raise ConfigError(f"workload {name!r}: {problem}")


def _model_problem(model: object, meta: bool = False) -> str | None:
    if not isinstance(model, nn.Module):
        return f"the model is {described(model)}, not a torch.nn.Module"
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        state = f"{len(params)} parameter(s), all frozen" if params else "no parameters"
        return (
            f"the model ({type_name(model)}) has {state}: there is nothing to train; return "
            "a model with trainable weights (or unfreeze them with requires_grad_(True))"
        )
    if not meta and any(p.is_meta for p in params):
        return (
            f"the model ({type_name(model)}) has parameters on the meta device (a shape, no "
            "data): create it on a real device, or materialise it with to_empty()"
        )
    return None


def _dataset_problem(dataset: object) -> str | None:
    """What is wrong with the dataset, judged from its length and its first item."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return (
            f"the dataset is {described(dataset)}: give a map-style dataset (len() and "
            "dataset[i]), e.g. torch.utils.data.TensorDataset(inputs, targets)"
        )
    data: Any = dataset
    try:
        size = len(data)
        item = data[0] if size > 0 else None
    except Exception as err:
        return (
            f"reading the dataset ({type_name(dataset)}) failed with {type_name(err)}: "
            f"{first_line(err)}: len(dataset) and dataset[0] must work"
        )
    if size == 0:
        return (
            f"the dataset ({type_name(dataset)}) is empty: there is no batch to train on; "
            "return one with samples"
        )
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        count = f" of {len(item)} items" if isinstance(item, (tuple, list)) else ""
        return (
            f"dataset[0] is {safe_repr(item, 60)} ({type_name(item)}{count}): each item must "
            "be an (input, target) pair, e.g. TensorDataset(inputs, targets)"
        )
    for name, part in zip(("input", "target"), item, strict=True):
        if not _batchable(part):
            return (
                f"dataset[0]'s {name} is {safe_repr(part, 60)} ({type_name(part)}): the "
                f"{name} must be a tensor (or numbers, numpy arrays, or a tuple/dict of "
                "them) for the loader to stack into a batch"
            )
    return None


def _batchable(value: object) -> bool:
    """Whether the default collate stacks ``value`` into a tensor batch: tensors, arrays and
    numbers, also inside a few levels of tuples, lists and dicts (strings and None it cannot
    give to a model)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (torch.Tensor, np.ndarray, np.generic)):
            continue
        if isinstance(item, numbers.Number) and not isinstance(item, complex):
            continue
        inside = [child for _, child in children(item)]
        if not inside or depth >= 3 or isinstance(item, (str, bytes)):
            return False
        stack += [(child, depth + 1) for child in inside]
    return True
