"""The planner's answer to ``parallel="auto"``: the layout of the model over the job's ranks.

Installed into ``gpukit.strategies.mesh`` when ``gpukit`` is imported, and asked once, at the
first model's ``rt.setup``. On GPUs the layout planner (:func:`choose_layout`) searches every
layout for the fastest that fits; a model it cannot read (it plans Llama-style decoders), or
a run on CPUs (whose speed it does not model), is sharded over every rank, as plain fsdp does,
and the line said on rank 0 tells which and why. A model that fits in no layout is an error.

>>> import torch
>>> from gpukit.devices import device
>>> sizes, why = choose(torch.nn.Linear(4, 4), 4, device("cpu"))
>>> sizes, why.split(":")[0]
({'dp_shard': 4}, 'every rank shards the model (fsdp)')
"""

from __future__ import annotations

from torch import nn

from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.planning.layout_search import choose_layout
from gpukit.strategies.mesh import use_layout_chooser

__all__ = ["choose"]


def choose(
    model: nn.Module,
    world_size: int,
    device: Device,
    *,
    activation_checkpointing: str = "off",
    float8: str | None = None,
) -> tuple[dict[str, int], str]:
    """The sizes of each dimension for ``model`` over ``world_size`` ranks of ``device``'s
    kind, and one line saying why (see the module docstring), planned with the run's
    ``activation_checkpointing`` and ``float8`` (what fits depends on both). The batch is not
    known when the model is set up: the planner plans one sample per data-parallel rank, so
    no pipeline is chosen."""
    shard = {"dp_shard": world_size}
    if device.type != "cuda":
        return shard, (
            f"every rank shards the model (fsdp): the layout planner models GPUs' speed, and "
            f"this run is on {device.type}"
        )
    import torch

    name = torch.cuda.get_device_name(device.index)
    try:
        return choose_layout(
            model,
            world_size,
            name,
            activation_checkpointing=activation_checkpointing,
            float8=float8,
        )
    except ConfigError as err:
        if "plans a Llama-style decoder" not in str(err):
            raise  # it read the model, and nothing fits: said as the planner says it
        return shard, (
            f"every rank shards the model (fsdp): the layout planner reads Llama-style "
            f"decoders, not {type(model).__name__}; give parallel={{...}} to choose yourself"
        )


use_layout_chooser(choose)
