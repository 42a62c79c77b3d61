"""Fully sharded data parallel (torch's FSDP2): each rank keeps 1/N of every weight, gradient
and optimizer state, and gathers a group's full weights only while it computes with them.

Without a wrapping policy: the model's repeated blocks (the blocks a model names in
``_no_split_modules``, as ``transformers`` models do, else the list of same-class modules
holding the most parameters) are sharded one group each, then the root holds the rest;
parameters tied across modules never span two groups (see ``_groups``). Each block may first
be checkpointed (its activations recomputed in the backward, ``_recompute``), compiled
(``torch.compile`` per block) and split across tensor-parallel ranks (``tp``: with the user's
``tp_plan``, else one read from the model, ``tensor_plans``).
``replicas`` > 1 shards within groups of ranks and replicates across them (HSDP: all-gathers
stay inside a group). A ``transformers`` model's ``save_pretrained`` writes its full weights
(``_hf_export``).

Gradient accumulation is a trade-off, chosen with ``accumulation``:

- ``"reduce-scatter"`` (default): every micro-batch reduce-scatters its gradients, so they
  stay sharded (1/N of the memory) at one reduce-scatter per micro-batch. Under HSDP the
  all-reduce across replicas still waits for the last micro-batch.
- ``"no-sync"``: the micro-batches keep full-size, unsharded gradients and the last one
  reduces them once: less communication, but each rank then holds a full gradient, the
  memory fsdp was meant to save.

Parameters become DTensors, sharded in place: the model the user holds is the sharded one.
An optimizer built before ``rt.setup`` is pointed at the sharded parameters there (with its
state, if it has any), so it trains them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from gpukit._util.checks import require_module
from gpukit._util.fake import real_tensors
from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import fsdp2, inside_wrappers, outermost
from gpukit.strategies._fsdp_api import is_sharded as is_sharded  # the checkpoints ask here
from gpukit.strategies._fsdp_options import FSDPOptions
from gpukit.strategies._fsdp_refusals import refuse_split_ties, shardable, split_tie
from gpukit.strategies._groups import Group, find_groups
from gpukit.strategies._hf_export import gather_on_save
from gpukit.strategies._norms import clip, total_norm
from gpukit.strategies._recompute import checkpoint_blocks
from gpukit.strategies._shard_plan import ShardPlan, describe_plan, show_once
from gpukit.strategies._user_sharded import (
    check_user_sharded,
    is_user_sharded,
    root_settings,
    user_groups,
)
from gpukit.strategies.base import MemoryAdvice, Recovery, Strategy, place
from gpukit.strategies.ddp import DDP, DDPRecovery
from gpukit.strategies.float8 import (
    check_float8_precision,
    check_float8_recipe,
    convert_float8,
    precompute_scales,
)
from gpukit.strategies.meta_init import is_meta, move_buffers
from gpukit.strategies.tensor_plans import check_tp, loss_parallel_criterion, parallelize
from gpukit.strategies.traits import STATES, Collective, Traits

log = logging.getLogger("gpukit")


class FSDPRecovery(DDPRecovery):
    """Out-of-memory recovery under fsdp: one rank only (every forward all-gathers from every
    rank), and a model whose pass failed halfway is reset."""

    strategy: FSDP

    @property
    def supported(self) -> bool:
        # Every forward all-gathers the weights from every rank: a rank that runs out of
        # memory halfway leaves the others waiting in a collective it will never join. One
        # rank has no one to leave waiting.
        return self.strategy.world_size == 1

    def reset_module(self, module: nn.Module) -> None:
        # A forward or backward that failed halfway leaves groups gathered and hooks armed.
        # The root resets every group under it (torch refuses the call on any other group).
        for root in outermost(module, fsdp2().FSDPModule):
            root.reset_iter_state()

    def advice(self, peak: int | None, imbalance: float | None) -> MemoryAdvice | None:
        o = self.strategy.options
        if o.activation_checkpointing != "off" and o.reshard is not False:
            return None
        tips = []
        if o.activation_checkpointing == "off":
            tips.append(
                "activation_checkpointing='selective' (or 'full') keeps fewer activations "
                "(gpukit train --activation-checkpointing selective)"
            )
        if o.reshard is False:
            tips.append("reshard=True frees each group's gathered weights after its forward")
        return MemoryAdvice(
            title="recompute activations / reshard",
            detail="; ".join(tips),
            freed=None,
            confidence=0.5,
        )


class FSDP(DDP):
    """Sharded training over processes started by ``Runtime.launch`` or a launcher; see the
    module docstring for the settings.

    >>> import gpukit as gk
    >>> strategy = gk.strategies.FSDP(activation_checkpointing="selective")
    >>> rt = gk.Runtime(strategy=strategy, devices=["cpu", "cpu"])
    >>> rt.world_size, strategy.name
    (2, 'fsdp')
    """

    name: ClassVar[str] = "fsdp"
    # Weights, gradients and optimizer state 1/N per rank; each block's weights all-gathered
    # for its forward and again for its backward, its gradients reduce-scattered, every
    # micro-step, each block's behind the compute of the block before.
    traits: ClassVar[Traits] = Traits(
        sharded=frozenset(STATES),
        gathers_weights=True,
        process_per_device=True,
        activation_checkpointing=True,
        collectives=(
            Collective("all-gather", "weights", "micro-step", "block", hidden_by="forward"),
            Collective("all-gather", "weights", "micro-step", "block", hidden_by="backward"),
            Collective("reduce-scatter", "gradients", "micro-step", "block", hidden_by="backward"),
        ),
    )
    recovery_class: ClassVar[type[Recovery]] = FSDPRecovery

    @classmethod
    def for_simulation(cls, *, activation_checkpointing: str = "off") -> Strategy:
        return cls(activation_checkpointing=activation_checkpointing)

    def __init__(
        self,
        *,
        reshard: bool | int | str = "auto",
        mixed: Any = None,
        offload: bool = False,
        activation_checkpointing: str = "off",
        compile: bool | str = False,
        tp: int = 1,
        replicas: int = 1,
        accumulation: str = "reduce-scatter",
        tp_plan: Any = None,
        loss_parallel: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
        float8: str | None = None,
    ) -> None:
        fsdp2()  # this torch has FSDP2, or a clear error now
        super().__init__(timeout=timeout)
        check_float8_recipe(float8, type(self).__name__)  # named as given: FSDP or Parallel
        self.options = FSDPOptions(
            reshard=reshard,
            mixed=mixed,
            offload=offload,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            tp=tp,
            replicas=replicas,
            accumulation=accumulation,
            tp_plan=tp_plan,
            float8=float8,
            loss_parallel=loss_parallel,
        )
        self.float8 = self.options.float8
        self.compile_backend: str | None = None  # torch.compile's backend for the blocks
        self.mesh: Any = None
        self.plans: list[ShardPlan] = []
        self._roots: dict[int, list[Any]] = {}  # id(set-up module) -> its sharded roots
        self.precision_name = "32"  # the run's precision, once the Runtime has checked it

    def enable_compile(self, backend: str | None, mode: str | None = None) -> bool:
        # Compiled as torchtitan does: each repeated block before it is sharded, so that
        # fully_shard's hooks stay between compiled blocks, outside the graphs.
        if mode not in (None, "default"):
            raise ConfigError(
                f"compile={mode!r}: fsdp compiles each repeated block with torch.compile's "
                "default mode (its collectives sit between the blocks, outside any graph): "
                "use compile=True under fsdp"
            )
        self.options = dataclasses.replace(self.options, compile="blocks")
        self.compile_backend = backend
        return False

    # -- processes ---------------------------------------------------------------------------
    def configure(self, devices: list[Device]) -> None:
        self.float8 = self.options.float8  # the setting lives in the options
        super().configure(devices)
        o = self.options
        if self.world_size % (o.tp * o.replicas):
            raise ConfigError(
                f"fsdp with tp={o.tp} and replicas={o.replicas} needs a multiple of "
                f"{o.tp * o.replicas} ranks, but this job has {self.world_size}: change the "
                "number of devices, tp or replicas"
            )
        shard = self.shard_size
        reshard = o.reshard
        if not isinstance(reshard, (bool, str)) and (reshard > shard or shard % reshard):
            raise ConfigError(
                f"FSDP(reshard={reshard}): reshards to a group of that many ranks, which must "
                f"divide the {shard} sharding rank(s); give a divisor of {shard}, True or False"
            )
        if o.offload and not any(d.type == "cuda" for d in devices):
            raise ConfigError(
                "FSDP(offload=True) keeps the sharded weights, gradients and optimizer state in "
                "CPU memory and copies each group to its GPU when needed, so it needs GPUs: "
                f"this job trains on {', '.join(map(str, devices))}. Drop offload=True"
            )

    def check_precision(self, precision: str) -> None:
        self.precision_name = precision  # checked again against a user-sharded model's policy
        policy = self.options.mixed_policy()
        if self.float8 is not None:
            bf16 = policy is not None and policy.param_dtype == torch.bfloat16
            check_float8_precision(self.float8, self.device, precision, bf16=bf16)
        if policy is not None and policy.param_dtype == torch.float16 and precision != "16-mixed":
            raise ConfigError(
                f"FSDP(mixed='fp16') computes in float16, whose small gradients round to zero "
                f"without loss scaling, and this run's precision is {precision!r}, which has no "
                "scaler: use precision='16-mixed' with it (its gradient scaler scales the "
                "loss), or mixed='bf16'"
            )

    @property
    def shard_size(self) -> int:
        """Ranks each weight is split across (the rest are replicas and tensor parallel)."""
        return self.world_size // (self.options.tp * self.options.replicas)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            o = self.options
            shape, names = [], []
            for size, name in ((o.replicas, "replicate"), (self.shard_size, "shard"), (o.tp, "tp")):
                if size > 1 or name == "shard":
                    shape.append(size)
                    names.append(name)
            # A mesh is made of real tensors (its ranks' coordinates): under the planner's fake
            # tensors, made with them paused.
            with real_tensors():
                self.mesh = init_device_mesh(
                    self.device.type, tuple(shape), mesh_dim_names=tuple(names)
                )

    def sampler_placement(self) -> tuple[int, int]:
        # Tensor-parallel ranks split one batch's computation: they read the same samples.
        tp = self.options.tp
        return self.world_size // tp, self.rank // tp

    # -- the model ---------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        module, meta, already = self._placed(module)
        if self.world_size > 1 and not meta:
            # Every rank shards its own copy: rank 0's weights must be everyone's first, as
            # DDP makes them (a checkpoint loaded on rank 0 only, ranks seeded apart), or the
            # model would be made of shards of different models. Shards the user made are
            # theirs to make consistent: only the plain tensors are broadcast.
            self.broadcast_state(module, sharded=False)
        return self._sharded(module, meta, already)

    def _placed(self, module: nn.Module) -> tuple[nn.Module, bool, list[Any]]:
        """``module`` checked and on this rank's device (a meta-device one left there), whether
        it is on the meta device, and the groups the user sharded in it themselves."""
        module = shardable(require_module(module, "rt.setup", meta=True))
        meta = is_meta(module)  # sharded first, then each rank's shards materialised
        if meta:
            self.meta_init.check(inside_wrappers(module))
        else:
            self.meta_init.not_used(inside_wrappers(module))
            module = place(module, self.device.torch)
        o = self.options
        # A model the user sharded with fully_shard keeps its groups, mesh and mp_policy: seen
        # before any broadcast (a DTensor has none) or grouping (see _user_sharded).
        already = user_groups(module)
        if already or is_user_sharded(module):
            check_user_sharded(module, already, o, self.precision_name, self.device.torch)
        self.check_model(module)  # before any collective
        return module, meta, already

    def _sharded(
        self, module: nn.Module, meta: bool, already: list[Any], groups: list[Group] | None = None
    ) -> nn.Module:
        """``module`` (every rank's copy alike) converted to float8, checkpointed, split across
        tensor-parallel ranks, compiled and sharded block by block (``groups``, default: found),
        then at its root, over the data mesh; a pipeline stage goes through here too."""
        api, o = fsdp2(), self.options
        data_mesh = self._data_mesh()
        settings: dict[str, Any] = {"mesh": data_mesh}
        if o.reshard_after_forward is not None:
            settings["reshard_after_forward"] = o.reshard_after_forward
        policy = o.mixed_policy()
        if policy is not None:
            settings["mp_policy"] = policy
        if o.offload:
            settings["offload_policy"] = api.CPUOffloadPolicy()
        if already:
            refuse_split_ties(module)
        if self.float8 is not None:  # first, as torchtitan: before tp, checkpointing, compile
            self._convert_float8(module, already)
        if groups is None:
            groups = [] if already else find_groups(module)
        blocks = [b for g in groups for b in g.modules]
        checkpoint_blocks(blocks, o.activation_checkpointing)
        if o.tp > 1:
            tp_mesh, lp = self.mesh["tp"], o.loss_parallel
            parallelize(inside_wrappers(module), tp_mesh, o.tp_plan, loss_parallel=lp)
        if o.compile:
            backend = {"backend": self.compile_backend} if self.compile_backend else {}
            for block in blocks:
                block.compile(**backend)
        for group in groups:
            target = group.modules[0] if len(group.modules) == 1 else group.modules
            self._shard(api, target, settings, group.names)
        root = inside_wrappers(module)
        if not isinstance(root, api.FSDPModule):
            # The root keeps its gathered weights after the forward: its backward comes
            # first, so freeing them would only gather them again at once.
            options = root_settings(already, module, settings) if already else dict(settings)
            options.setdefault("reshard_after_forward", o.reshard_after_forward or False)
            self._shard(api, root, options, ["(root)"])
        if meta:  # offloaded shards live in CPU memory, buffers on the device (not offloaded)
            cpu = torch.device("cpu")
            self.meta_init.materialise(root, cpu if o.offload else self.device.torch)
            if o.offload:
                move_buffers(root, self.device.torch)
        gather_on_save(root, self)  # a transformers model's save_pretrained writes full weights
        plan = describe_plan(module, groups, self, already=already)
        self.plans.append(plan)
        if self.rank == 0:
            show_once(plan)
        return module

    def _convert_float8(self, module: nn.Module, already: list[nn.Module]) -> None:
        if already or is_user_sharded(module):
            raise ConfigError(
                f"FSDP(float8={self.float8!r}) converts the Linear layers before sharding, but "
                "this model was already sharded with fully_shard: let gpukit shard it (do not "
                "call fully_shard yourself), or convert it with torchao before you shard it "
                "and drop float8="
            )
        assert self.float8 is not None
        convert_float8(inside_wrappers(module), self.float8, self.device, fsdp=True, rank=self.rank)

    def after_optimizer_step(self, module: nn.Module) -> None:
        # Weights all-gathered in float8 ("tensorwise"): every weight's scale for the next
        # forward, in one all-reduce, now that the optimizer has changed the weights.
        if self.float8 == "tensorwise":
            precompute_scales(module)

    def check_model(self, module: nn.Module) -> None:
        o = self.options
        if o.tp > 1 and (o.tp_plan is None or o.tp_plan == "auto"):
            check_tp(inside_wrappers(module), o.tp)

    def _data_mesh(self) -> Any:
        names = self.mesh.mesh_dim_names
        data = tuple(n for n in names if n != "tp")
        return self.mesh[data] if len(data) < len(names) else self.mesh

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: str | None
    ) -> Callable[..., torch.Tensor]:
        fn = super().setup_criterion(fn, reduction)
        return loss_parallel_criterion(fn) if self.options.loss_parallel else fn

    def _shard(self, api: Any, target: Any, settings: dict[str, Any], names: list[str]) -> None:
        try:
            api.fully_shard(target, **settings)
        except (ValueError, AssertionError, RuntimeError) as err:
            said = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            if "shared with a parameter already managed" in said:
                raise split_tie(", ".join(names), said) from None
            raise ConfigError(f"fsdp could not shard {', '.join(names)}: {said}") from err

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # sharded in place: no wrapper around the user's model

    def set_backward_sync(self, module: nn.Module, enabled: bool) -> None:
        no_sync, replicas = self.options.accumulation == "no-sync", self.options.replicas > 1
        if not (no_sync or replicas):
            return  # reduce-scatter every micro-batch: nothing to switch
        roots = self._roots.get(id(module))
        if roots is None:  # looked up once per model: this runs before every backward
            roots = self._roots[id(module)] = outermost(module, fsdp2().FSDPModule)
        for root in roots:
            if no_sync:
                root.set_requires_gradient_sync(enabled)
            else:
                # Reduce-scatter within each replica every micro-batch (gradients stay
                # sharded); the all-reduce across replicas only once, on the last.
                root.set_requires_all_reduce(enabled)

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        if self.options.tp == 1:  # one mesh: torch's own clipping, as a plain program has it
            return super().clip_gradients(params, max_norm)
        return clip([p.grad for p in params if p.grad is not None], max_norm)

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        return None if self.options.tp == 1 else total_norm(grads)

    def check_gradients(self, module: nn.Module) -> None:
        """fsdp reduce-scatters whole groups: a parameter without a gradient is reduced as
        zeros, so unused parameters need no check here."""

    def teardown(self) -> None:
        self.mesh = None
        self._roots.clear()
        super().teardown()
