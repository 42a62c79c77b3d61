"""What ``rt.setup`` is given, in the orders Accelerate and Fabric programs give it: the model
first, with its optimizers, schedulers, DataLoaders and other state (``accelerator.prepare``,
``fabric.setup``), or DataLoaders alone (``fabric.setup_dataloaders``), before the model is set
up or after it.

Every loader is treated alike whichever call sets it up: sharded for this rank, its batches
moved to the device, registered for checkpoints in the order the program set it up. A loader
set up before the model keeps its sharding when ``strategy="auto"`` takes fsdp in place of ddp
at the model's setup: both shard the data by rank (the ranks and their process group are the
same). That choice reads the batch size of a loader given with the model, else of the first
one set up before it.

>>> import torch
>>> from torch.utils.data import DataLoader
>>> loader = DataLoader(range(8), batch_size=4)
>>> split_setup((loader,)) == (None, (loader,), 1)
True
>>> split_setup((torch.nn.Linear(2, 1),))[1:]
((), 2)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from gpukit._util.checks import require_module
from gpukit._util.text import described, type_name
from gpukit.errors import ConfigError
from gpukit.runtime.data.loader import DeviceLoader


def split_setup(objects: tuple[Any, ...]) -> tuple[nn.Module | None, tuple[Any, ...], int]:
    """The model among ``rt.setup``'s arguments (None: DataLoaders alone), the rest, and the
    argument number of the first of the rest (for the refusals that name it). Anything else
    where the model goes, or beside DataLoaders given alone, is a ConfigError that says what
    to write."""
    if not objects:
        raise ConfigError(
            "rt.setup() got nothing: pass the model and what trains it, "
            "rt.setup(model, optimizer, loader), or DataLoaders alone, "
            "rt.setup(train_loader, val_loader)"
        )
    first, rest = objects[0], objects[1:]
    if isinstance(first, nn.Module):
        return first, rest, 2
    if not isinstance(first, (DataLoader, DeviceLoader)):
        require_module(first, "rt.setup")  # not a model: its error says what goes there
    for i, obj in enumerate(objects):
        if isinstance(obj, (DataLoader, DeviceLoader)):
            continue
        if isinstance(obj, nn.Module):
            raise ConfigError(
                f"rt.setup got the model, {type_name(obj)}, as argument {i + 1}, after a "
                "DataLoader: the model comes first, rt.setup(model, optimizer, loader), or set "
                "up the loaders with a call of their own, rt.setup(train_loader, val_loader)"
            )
        shown = (
            f"the optimizer ({type_name(obj)})"
            if isinstance(obj, torch.optim.Optimizer)
            else described(obj)
        )
        raise ConfigError(
            f"rt.setup got {shown} as argument {i + 1} beside DataLoaders without a "
            "model: without one, rt.setup takes DataLoaders only (as Fabric's "
            "setup_dataloaders does); give optimizers, schedulers and other state with their "
            "model, rt.setup(model, optimizer, scheduler)"
        )
    return None, objects, 1


def returned(module: nn.Module | None, rest: list[Any]) -> Any:
    """What ``rt.setup`` returns: the model alone, or the model and the rest in order; for
    DataLoaders alone, the one loader, or a tuple of them in order."""
    if module is not None:
        return (module, *rest) if rest else module
    return rest[0] if len(rest) == 1 else tuple(rest)
