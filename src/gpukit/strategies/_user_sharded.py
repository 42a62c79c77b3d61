"""Models the user already sharded with FSDP2's ``fully_shard`` before ``rt.setup``.

Such a model is kept exactly as sharded: its groups, their mesh and their ``mp_policy``. Its
DTensor parameters are never broadcast (a DTensor has no broadcast, and each rank holds a
different shard by design): making the shards one model is the user's init, as in the plain
program (the same seed on every rank, or a checkpoint loaded with DCP). gpukit checks what it
can without gathering the model: the sharded parameters' mesh is on this run's device type,
no tie is split across groups (``_fsdp_refusals.refuse_split_ties``), and no gpukit
setting would silently override or be ignored by the user's own (``mixed``, ``offload``,
``tp``, ``activation_checkpointing``, ``compile``, and a ``precision`` beside the groups'
own mixed precision). Parameters and buffers the user left unsharded are still broadcast from
rank 0, as for any model, and the root, if the user did not shard it, is sharded on the
user's mesh with the user's ``mp_policy`` (when all groups share one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import fsdp2, is_dtensor


def user_groups(module: nn.Module) -> list[Any]:
    """The modules of ``module`` that ``fully_shard`` already manages (FSDP2's
    ``FSDPModule``), or [] when there are none (or this torch has no FSDP2)."""
    try:
        cls = fsdp2().FSDPModule
    except ConfigError:
        return []
    return [m for m in module.modules() if isinstance(m, cls)]


def is_user_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds a group sharded by ``fully_shard`` or a DTensor parameter."""
    return bool(user_groups(module)) or any(is_dtensor(p) for p in module.parameters())


def refuse_for_replicas(module: nn.Module, strategy: str) -> None:
    """A strategy that replicates whole models (ddp, and "auto" for several devices) cannot
    take a model the user sharded: its first act, broadcasting rank 0's weights, has no
    meaning for shards, and its all-reduce would mix them."""
    if is_user_sharded(module):
        raise ConfigError(
            f"strategy {strategy!r} replicates the whole model on every rank, but this model "
            "was already sharded with fully_shard (FSDP2: its parameters are DTensors): use "
            "strategy='fsdp', which keeps your groups, mesh and mp_policy as they are, or "
            "do not call fully_shard yourself"
        )


def mixed_policies(groups: list[Any]) -> list[Any]:
    """The distinct mixed-precision policies of the user's groups (their ``mp_policy``)."""
    found: list[Any] = []
    for group in groups:
        # torch keeps the policy a group was sharded with on its state (2.4 onwards).
        state = group._get_fsdp_state() if hasattr(group, "_get_fsdp_state") else None
        policy = getattr(state, "_mp_policy", None)
        if policy is None:
            param_group = getattr(state, "_fsdp_param_group", None)
            policy = getattr(param_group, "mp_policy", None)
        if policy is not None and policy not in found:
            found.append(policy)
    return found


def casts(policy: Any) -> bool:
    """Whether ``policy`` changes any dtype (a default MixedPrecisionPolicy changes none)."""
    return any(
        getattr(policy, f, None) is not None
        for f in ("param_dtype", "reduce_dtype", "output_dtype")
    )


def check_user_sharded(
    module: nn.Module, groups: list[Any], options: Any, precision: str, device: torch.device
) -> None:
    """ConfigError unless gpukit can keep the user's sharding as it is (see the module)."""
    given = [
        name
        for name, on in (
            ("mixed", options.mixed is not None),
            ("offload", options.offload),
            ("tp", options.tp > 1),
            ("activation_checkpointing", options.activation_checkpointing != "off"),
            ("compile", bool(options.compile)),
        )
        if on
    ]
    if given:
        raise ConfigError(
            f"fsdp: the model was already sharded with fully_shard, so gpukit keeps its groups "
            f"and their settings and cannot apply FSDP({', '.join(given)}=...) to blocks it did "
            "not choose (it would be ignored or recompute, compile or cast what you sharded): "
            "drop those settings and pass them to your own fully_shard calls (mp_policy, "
            "offload_policy), or let gpukit shard the model"
        )
    policies = [p for p in mixed_policies(groups) if casts(p)]
    if policies and precision != "32":
        raise ConfigError(
            f"fsdp: the model was sharded with fully_shard(mp_policy={policies[0]}) and this "
            f"run also asks for precision={precision!r} (autocast around the forward): the two "
            "would stack, and autocast would decide the dtype of what your policy computes. "
            "Keep one: precision='32' (your mp_policy alone decides, as in your own program), "
            "or drop mp_policy from your fully_shard calls"
        )
    for name, p in module.named_parameters():
        if not is_dtensor(p):
            continue
        mesh: Any = getattr(p, "device_mesh")  # noqa: B009  (a DTensor's)
        if mesh.device_type != device.type:
            raise ConfigError(
                f"fsdp: {name} was sharded on a {mesh.device_type!r} mesh, but this run trains "
                f"on {device.type!r}: build the mesh given to fully_shard on the run's device "
                "(init_device_mesh(rt.device.type, ...)), or shard after moving the model"
            )


def root_settings(groups: list[Any], module: nn.Module, settings: dict[str, Any]) -> dict[str, Any]:
    """gpukit's settings for the root of a model whose blocks the user sharded: the user's
    mesh and ``mp_policy`` (when all groups share one), so the root matches its groups."""
    out = dict(settings)
    mesh = next((getattr(p, "device_mesh") for p in module.parameters() if is_dtensor(p)), None)  # noqa: B009
    if mesh is not None:
        out["mesh"] = mesh
    policies = mixed_policies(groups)
    if len(policies) == 1:
        out["mp_policy"] = policies[0]
    return out
