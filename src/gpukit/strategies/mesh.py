"""Every parallelism dimension on one device mesh: pipeline stages x data (replicas x shards)
x context x tensor, as torchtitan composes them.

``Parallel`` is fsdp generalised: its mesh has the five dimensions of a
:class:`~gpukit.strategies.layout.Layout` (size-one dimensions included, so that every rank
finds every name), and the model is prepared in torchtitan's order: split into pipeline stages,
tensor parallel (a plan gpukit reads off the model, or the user's), context parallel,
activation checkpointing, compile, then ``fully_shard`` over the data dimensions (``dp_shard``
and ``cp`` together; across ``dp_replicate`` as HSDP).

Ranks that split one batch's work (tensor, context and pipeline ranks) read the same samples:
the data is sharded over ``dp_replicate x dp_shard`` only.

>>> import gpukit as gk
>>> strategy = gk.strategies.Parallel(dp_shard=-1, tp=2)
>>> rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4)
>>> strategy.layout.described(), strategy.sampler_placement()
('dp_shard 2 x tp 2', (2, 0))
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from gpukit._util.fake import real_tensors
from gpukit._util.tree import map_tensors, tensors
from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies._criterion import reduction_of
from gpukit.strategies._fsdp_options import FSDPOptions
from gpukit.strategies._norms import scale, total_norm
from gpukit.strategies.ddp import DDP
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.layout import DIMS, Layout
from gpukit.strategies.layout_choice import ask_chooser, check_auto, use_layout_chooser
from gpukit.strategies.meta_init import user_model
from gpukit.strategies.pipeline import (
    Pipeline,
    PipelineCriterion,
    PipelineOptions,
    combined_norm,
)
from gpukit.strategies.pipeline_stages import staged
from gpukit.strategies.sequence_batches import SequenceShards
from gpukit.strategies.sequence_parallel import (
    CP_ATTENTION,
    CpAttention,
    Ring,
    SequenceParallel,
    Ulysses,
    check_cp,
    check_ring,
)
from gpukit.strategies.traits import Collective, Traits

log = logging.getLogger("gpukit")


@dataclasses.dataclass(frozen=True)
class ParallelOptions(FSDPOptions):
    """fsdp's options, with the sizes of the layout's dimensions as the run took them."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    cp: int = 1


class Parallel(FSDP):
    """Training over one mesh of every dimension; see the module docstring.

    ``dp_replicate``, ``dp_shard``, ``tp``, ``pp``, ``cp``: the layout's sizes (one may be -1:
    what the others leave); or ``layout="auto"``: the planner chooses them for the model at
    ``rt.setup`` (every rank shards until then). ``tp_plan``: the user's tensor-parallel
    plan (default: read off the model). ``cp_attention``: how attention sees the whole
    sequence under ``cp`` > 1, ``"ulysses"`` (any attention kernel) or ``"ring"`` (torch's,
    CUDA only; see ``gpukit.strategies.sequence_parallel``). ``pp_schedule``,
    ``pp_microbatches``, ``pp_stages_per_rank``, ``pp_split``: the pipeline's
    (``gpukit.strategies.pipeline``). The other keywords are fsdp's (``gpukit.strategies.FSDP``).
    """

    name: ClassVar[str] = "parallel"
    traits: ClassVar[Traits] = Traits(
        sharded=FSDP.traits.sharded,
        gathers_weights=True,
        process_per_device=True,
        activation_checkpointing=True,
        collectives=(
            *FSDP.traits.collectives,
            Collective("all-reduce", "samples", "micro-step", "block"),  # tensor parallel
        ),
    )

    def __init__(
        self,
        *,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        layout: str | None = None,
        tp_plan: Any = None,
        cp_attention: CpAttention = "ulysses",
        pp_schedule: str = "1F1B",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        pp_split: list[str] | None = None,
        reshard: bool | int | str = "auto",
        mixed: Any = None,
        activation_checkpointing: str = "off",
        compile: bool | str = False,
        accumulation: str = "reduce-scatter",
        float8: str | None = None,
        loss_parallel: bool = False,
        timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    ) -> None:
        if tp == -1 or dp_replicate == -1:
            raise ConfigError(
                "parallel: tp and dp_replicate take a size, not -1 (each decides how a layer "
                "or the data is split); give -1 to dp_shard, pp or cp"
            )
        if layout is not None:
            check_auto(layout, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp)
        self.auto = layout == "auto"
        if cp_attention not in CP_ATTENTION:
            raise ConfigError(
                f"Parallel(cp_attention={cp_attention!r}): give one of "
                f"{', '.join(map(repr, CP_ATTENTION))}"
            )
        self.cp_attention = cp_attention
        self.requested = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp)
        split = tuple(pp_split) if isinstance(pp_split, (list, tuple)) else pp_split
        self.pipeline_options = PipelineOptions(
            pp_schedule,
            pp_microbatches,
            pp_stages_per_rank,
            split,
        )
        self._pipelines: list[Pipeline] = []
        super().__init__(
            reshard=reshard,
            mixed=mixed,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
            tp=tp,
            replicas=dp_replicate,
            accumulation=accumulation,
            float8=float8,
            loss_parallel=loss_parallel,
            tp_plan=tp_plan if tp_plan is not None or tp == 1 else "auto",
            timeout=timeout,
        )
        self.layout = self.requested
        self._cut: set[int] = set()  # the sequence lengths local_batch has cut batches to
        self._check_zero_bubble()

    def _check_zero_bubble(self) -> None:
        o, schedule = self.options, self.pipeline_options.schedule
        if "ZeroBubble" in schedule and (o.activation_checkpointing != "off" or o.compile):
            raise ConfigError(
                f"pp_schedule={schedule!r} splits each backward in two (the inputs' "
                "gradients, then the weights'), which fsdp's per-block groups, activation "
                "checkpointing and compiled blocks do not follow: each stage is sharded whole, "
                "so drop activation_checkpointing and compile, or use 'Interleaved1F1B'"
            )

    def described(self) -> dict[str, object]:
        fields = super().described()
        fields["layout"] = self.layout.described()
        if self.layout.pp > 1:
            o = self.pipeline_options
            fields["pipeline"] = (
                f"{o.schedule} x {o.microbatches_for(self.layout.pp)} micro-batches"
            )
        if self.layout.cp > 1:
            fields["cp_attention"] = self.cp_attention
        return fields

    # -- processes ---------------------------------------------------------------------------
    def configure(self, devices: list[Device]) -> None:
        DDP.configure(self, devices)  # the ranks first: -1 takes what the others leave
        self._take_layout(self.requested.resolved(self.world_size))
        if self.layout.pp == 1 and self.pipeline_options != PipelineOptions():
            raise ConfigError(
                f"parallel: pp_* settings were given with pp=1, so there is no pipeline to "
                f"schedule ({self.pipeline_options}): set pp=2 or more, or leave them out"
            )
        super().configure(devices)
        self._check_context_parallel()

    def _check_context_parallel(self) -> None:
        """Refuse what context parallel cannot go with, before any collective (again at
        ``rt.setup`` for the layout ``layout="auto"`` chose there)."""
        cp = self.layout.cp
        if cp > 1 and self.options.compile:
            raise _compiled_blocks(cp)
        if cp > 1 and self.cp_attention == "ring":
            check_ring(self.device.torch)

    def enable_compile(self, backend: str | None, mode: str | None = None) -> bool:
        if self.layout.cp != 1:  # as resolved over the ranks (cp=-1 may be one)
            raise _compiled_blocks(self.layout.cp)
        compiles = super().enable_compile(backend, mode)
        self._check_zero_bubble()
        return compiles

    def check_precision(self, precision: str) -> None:
        if self.layout.pp > 1 and precision == "16-mixed":
            raise ConfigError(
                "precision='16-mixed' cannot go with pipeline parallel: its gradient scaler "
                "scales the loss in rt.backward, but the pipeline's schedule runs the backward "
                "inside the forward, micro-batch by micro-batch, and the scaler's skipped "
                "steps would have to agree across stages. Use precision='bf16-mixed' (no "
                "scaler needed) or '32'"
            )
        super().check_precision(precision)

    @property
    def splits_model(self) -> bool:
        return self.layout.pp > 1

    def _take_layout(self, layout: Layout) -> None:
        """Train over ``layout``: fsdp's options follow it, and say it (a run's config.toml
        reads the sizes there)."""
        self.layout = layout
        plan = self.options.tp_plan if layout.tp > 1 else None
        fields = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(FSDPOptions)}
        fields.update(tp=layout.tp, replicas=layout.dp_replicate, tp_plan=plan)
        if layout.tp > 1 and plan is None:
            fields["tp_plan"] = "auto"
        self.options = ParallelOptions(
            **fields,
            dp_replicate=layout.dp_replicate,
            dp_shard=layout.dp_shard,
            pp=layout.pp,
            cp=layout.cp,
        )

    def check_model(self, module: nn.Module) -> None:
        super().check_model(module)
        if self.cp_attention == "ulysses":  # after tp's check: the heads divide by tp
            auto = self.options.tp_plan in (None, "auto")
            check_cp(user_model(module), self.layout.cp, self.layout.tp if auto else 1)

    @property
    def shard_size(self) -> int:
        # fully_shard spans the context ranks too: they hold the same weights, and their
        # gradients (each of one part of the sequence) are reduced with the data's.
        return self.layout.dp_shard * self.layout.cp

    def setup_environment(self) -> None:
        DDP.setup_environment(self)
        if self.mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            sizes = self.layout.sizes()
            with real_tensors():
                self.mesh = init_device_mesh(
                    self.device.type, tuple(sizes.values()), mesh_dim_names=DIMS
                )

    def sampler_placement(self) -> tuple[int, int]:
        at = self.layout.coordinates(self.rank)
        return self.layout.data_parallel, at["dp_replicate"] * self.layout.dp_shard + at["dp_shard"]

    @property
    def sequence_shards(self) -> SequenceShards | None:
        """This rank's part of every sequence under context parallelism (None without)."""
        if self.layout.cp == 1:
            return None
        return SequenceShards(self.layout.cp, self.layout.coordinates(self.rank)["cp"])

    def local_batch(self, batch: Any) -> Any:
        shards = self.sequence_shards
        if shards is None:
            return batch
        local = shards.batch(batch)
        self._cut.update(t.shape[1] for t in tensors(local) if t.dim() > 1)
        return local

    def whole_samples(self, data: Any) -> Any:
        shards = self.sequence_shards
        if shards is None:
            return data
        group = self.mesh["cp"].get_group()
        return map_tensors(data, lambda t: shards.whole(t, group) if t.dim() > 1 else t)

    def _data_mesh(self) -> Any:
        # fully_shard's mesh: shards over dp_shard x cp (flattened into one dimension), and
        # across dp_replicate as HSDP's 2-D (replicas, shards) mesh.
        shards = "dp_shard"
        if self.layout.cp > 1:
            shards = "dp_shard_cp"
            if shards not in _flattened(self.mesh):
                self.mesh["dp_shard", "cp"]._flatten(shards)
        if self.layout.dp_replicate == 1:
            return self.mesh[shards]
        return self.mesh["dp_replicate", shards]

    # -- the model ---------------------------------------------------------------------------
    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.auto:
            _choose_layout(self, module)
            self._check_context_parallel()
        shards = self.sequence_shards
        if self.layout.pp > 1:
            pipeline = staged(self, module, self.pipeline_options, self.layout)
            self._pipelines.append(pipeline)
            if shards is not None:  # each stage's attention across the context ranks
                for stage in pipeline.stages:
                    SequenceParallel(stage, shards, self._attention(shards), self._cut)
            return pipeline
        if shards is None:
            return super().setup_module(module)
        module = super().setup_module(module)
        # On the user's model, inside gpukit's wrappers: a call through rt.unwrap(model) is
        # context-parallel too (its weights are sharded over the cp ranks alike).
        SequenceParallel(user_model(module), shards, self._attention(shards), self._cut)
        return module

    def _attention(self, shards: SequenceShards) -> Callable[..., torch.Tensor]:
        if self.cp_attention == "ring":
            return Ring(self.mesh["cp"])
        return Ulysses(shards, self.mesh["cp"].get_group())

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.view if isinstance(module, Pipeline) else module

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: str | None
    ) -> Callable[..., torch.Tensor]:
        computed = super().setup_criterion(fn, reduction)  # under loss_parallel, if asked
        if self.layout.pp == 1:
            return computed
        if reduction_of(fn, reduction) != "mean":
            raise ConfigError(
                "pipeline parallel averages the micro-batches' losses: give a criterion that "
                "takes the mean over its samples (reduction='mean')"
            )
        return PipelineCriterion(computed)

    def loss_weight(self, weight: float) -> None:
        for pipeline in self._pipelines:
            pipeline.run.weight = weight

    def backward_done(self, loss: torch.Tensor) -> bool:
        return any(p.run.backward_done(loss) for p in self._pipelines)

    def set_backward_sync(self, module: nn.Module, enabled: bool) -> None:
        if isinstance(module, Pipeline):
            # The schedule reduces fsdp's gradients itself; tied copies are summed once,
            # before the optimizer steps.
            module.run.sync_ties = enabled
            return
        super().set_backward_sync(module, enabled)

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        if not self._pipelines:
            return super().clip_gradients(params, max_norm)
        grads = [p.grad for p in params if p.grad is not None]
        norm = self.gradient_norm(grads)
        assert norm is not None  # a pipeline's norm is always its own
        scale(grads, norm, max_norm)
        return norm

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        if not self._pipelines:
            return super().gradient_norm(grads)
        # A tied parameter's copies on later stages hold the same gradient: counted once.
        again = {id(p.grad) for pl in self._pipelines for p in pl.run.norm_skip}
        counted = [g for g in grads if id(g) not in again]
        return combined_norm(total_norm(counted).to(self.device.torch), self.mesh["pp"].get_group())

    def teardown(self) -> None:
        self._pipelines.clear()
        super().teardown()


def _compiled_blocks(cp: int) -> ConfigError:
    return ConfigError(
        f"parallel cp={cp} with compile: compiled blocks are not context-parallel yet; drop "
        "compile, or use cp=1"
    )


def _choose_layout(self: Parallel, module: nn.Module) -> None:
    """``layout="auto"``: the planner's layout for ``module`` over this job's ranks, taken at
    the first model's set-up (the mesh made again where it differs)."""
    # Planned with the run's own activation checkpointing and float8: what fits depends on them.
    sizes, reason = ask_chooser(
        module,
        self.world_size,
        self.device,
        activation_checkpointing=self.options.activation_checkpointing,
        float8=self.options.float8,
    )
    self.auto = False
    chosen = Layout.of(sizes).resolved(self.world_size)
    if self.rank == 0:
        log.warning("gpukit: parallel layout %s: %s", chosen.described(), reason)
    if chosen == self.layout:
        return
    self._take_layout(chosen)
    self.mesh = None
    self.setup_environment()


def _flattened(mesh: Any) -> dict[str, Any]:
    """The dimensions flattened on ``mesh``'s root so far (torch keeps them there)."""
    root = getattr(mesh, "_get_root_mesh", lambda: mesh)()
    return getattr(root, "_flatten_mapping", {})


__all__ = ["Parallel", "ParallelOptions", "use_layout_chooser"]
