"""The settings of ``gk.strategies.FSDP``, checked before any process starts.

Each check raises a ConfigError that names the setting, what was given, and what to give.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import fsdp2
from gpukit.strategies._recompute import MODES
from gpukit.strategies.float8 import check_float8_recipe

ACCUMULATION = ("reduce-scatter", "no-sync")
_MIXED = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FSDPOptions:
    """``reshard``: "auto" (torch's choice: reshard every group after its forward except the
    root's), True, False (keep the gathered weights from forward to backward: one all-gather
    per group per step instead of two, at the memory of unsharded weights), or a number of
    ranks to reshard to (a smaller group's all-gather in the backward). ``mixed``: None (the
    weights stay in their dtype; the Runtime's precision applies), "bf16"/"fp16" (weights
    gathered and computed in that dtype, gradients reduced in float32), or a torch
    ``MixedPrecisionPolicy``. ``accumulation``: what the micro-batches before an optimizer
    step do with their gradients (see ``gpukit.strategies.fsdp``). ``float8``: None, or the
    torchao recipe the Linear layers compute in ("tensorwise": weights all-gathered in
    float8; "rowwise"; see ``gpukit.strategies.float8``). ``tp_plan``: None or "auto"
    (read from the model, ``tensor_plans.auto_plan``), a dict, or a function of the model.
    ``loss_parallel``: the output layer's logits stay split by vocabulary and
    ``rt.setup_criterion``'s cross entropy runs under torch's ``loss_parallel``."""

    reshard: bool | int | str = "auto"
    mixed: Any = None
    offload: bool = False
    activation_checkpointing: str = "off"
    compile: bool | str = False
    tp: int = 1
    replicas: int = 1
    accumulation: str = "reduce-scatter"
    tp_plan: Any = None
    float8: str | None = None
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        _check_reshard(self.reshard)
        check_float8_recipe(self.float8, "FSDP")
        _check_mixed(self.mixed)
        for name in ("offload", "loss_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"FSDP({name}={described(getattr(self, name))}): give True or False"
                )
        if self.activation_checkpointing not in MODES or not isinstance(
            self.activation_checkpointing, str
        ):
            raise ConfigError(
                f"FSDP(activation_checkpointing={described(self.activation_checkpointing)}): give "
                "'off', 'full' (recompute each block's forward in the backward) or 'selective' "
                "(keep every second matrix product's output and attention's, recompute the rest)"
            )
        if self.compile is not False and self.compile != "blocks" and self.compile is not True:
            raise ConfigError(
                f"FSDP(compile={described(self.compile)}): give False, or 'blocks' (True means "
                "the same) to torch.compile each repeated block before sharding it"
            )
        for name in ("tp", "replicas"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ConfigError(
                    f"FSDP({name}={described(value)}): give a whole number of ranks, 1 or more"
                )
        if self.accumulation not in ACCUMULATION or not isinstance(self.accumulation, str):
            raise ConfigError(
                f"FSDP(accumulation={described(self.accumulation)}): give 'reduce-scatter' "
                "(gradients stay sharded; one reduce-scatter per micro-batch) or 'no-sync' "
                "(one reduce-scatter per step; full-size gradients kept until then)"
            )
        if self.tp == 1 and (self.tp_plan is not None or self.loss_parallel):
            given = "tp_plan=..." if self.tp_plan is not None else "loss_parallel=True"
            raise ConfigError(
                f"FSDP({given}) was given with tp=1, so nothing would be split: give the "
                f"number of tensor-parallel ranks too, e.g. FSDP(tp=2, {given}), or drop it"
            )
        plan = self.tp_plan
        if not (plan is None or plan == "auto" or isinstance(plan, dict) or callable(plan)):
            raise ConfigError(
                f"FSDP(tp_plan={described(plan)}): give None or 'auto' (a plan read from the "
                "model: gpukit.strategies.tensor_plans.auto_plan), a dict of module names "
                "(wildcards allowed) to torch's ParallelStyles, e.g. {'blocks.*.mlp.0': "
                "ColwiseParallel(), 'blocks.*.mlp.2': RowwiseParallel()}, or a function model "
                "-> such a dict"
            )

    def mixed_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` for ``fully_shard`` (None: torch's default)."""
        if self.mixed is None:
            return None
        if isinstance(self.mixed, str):
            policy = fsdp2().MixedPrecisionPolicy
            return policy(param_dtype=_MIXED[self.mixed], reduce_dtype=torch.float32)
        return self.mixed

    @property
    def reshard_after_forward(self) -> bool | int | None:
        return None if self.reshard == "auto" else self.reshard  # type: ignore[return-value]


def _check_reshard(value: object) -> None:
    if value == "auto" and isinstance(value, str):
        return
    if isinstance(value, bool):
        return
    if isinstance(value, numbers.Integral) and int(value) >= 1:
        return
    raise ConfigError(
        f"FSDP(reshard={described(value)}): give 'auto', True (free the gathered weights "
        "after each forward), False (keep them until the backward) or a number of ranks to "
        "reshard to, which must divide the number of sharding ranks"
    )


def _check_mixed(value: object) -> None:
    if value is None or (isinstance(value, str) and value in _MIXED):
        return
    if isinstance(value, fsdp2().MixedPrecisionPolicy):
        return
    raise ConfigError(
        f"FSDP(mixed={described(value)}): give None (weights in their own dtype), 'bf16' or "
        "'fp16' (gathered and computed in that dtype, gradients reduced in float32), or a "
        "torch.distributed.fsdp.MixedPrecisionPolicy"
    )
