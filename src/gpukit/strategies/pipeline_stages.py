"""A model made into this rank's pipeline stages under ``Parallel(pp=...)``: every rank starts
from rank 0's whole model, cuts it (``pipeline_split``), and prepares each of its stages as
fsdp prepares a whole model (tensor parallel, checkpointing, compile, ``fully_shard`` over the
data mesh); parameters tied across stages get the ranks that hold them in one group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import inside_wrappers
from gpukit.strategies._groups import Group, find_groups
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.layout import Layout
from gpukit.strategies.pipeline import Pipeline, PipelineOptions, PipelineRun
from gpukit.strategies.pipeline_split import Cut, holding, stage_module, tied_names, union


def staged(strategy: FSDP, module: nn.Module, options: PipelineOptions, layout: Layout) -> Pipeline:
    """``module`` (as ``rt.setup`` gives it) as this rank's stages of ``layout``'s pipeline,
    prepared by ``strategy`` (the one mesh's); see the module doc."""
    module, meta, already = strategy._placed(module)
    if meta or already:
        what = "built on the meta device" if meta else "sharded by the user"
        raise ConfigError(
            f"pipeline parallel cuts a whole model into stages, and this one was {what}: "
            "give the model with its weights, unsharded"
        )
    inner = inside_wrappers(module)
    # Every rank cuts its own copy: rank 0's weights first, so that the stages are pieces of
    # one model (and tied copies start equal).
    strategy.broadcast_state(inner, sharded=False)
    pp = layout.pp
    count = pp * options.per_rank
    cut = Cut.of(inner, count, list(options.split) if options.split else None)
    pp_rank = layout.coordinates(strategy.rank)["pp"]
    ids = options.stage_ids(pp, pp_rank)
    holders = [options.holder(s, pp) for s in range(count)]
    ties = [
        (names, sorted({s for n in names for s in holding(inner, cut, n)}))
        for names in tied_names(inner)
    ]
    cuts = [stage_module(inner, cut, s) for s in ids]
    # Zero-bubble schedules split each backward in two (inputs' gradients, then weights'):
    # fsdp's groups inside a stage would reduce their gradients after the first half. Each
    # such stage is one group (Parallel refuses checkpointing and compile with them).
    whole = "ZeroBubble" in options.schedule
    stages = [
        strategy._sharded(_rewrapped(module, c), False, [], [] if whole else _blocks(c, cut, s))
        for c, s in zip(cuts, ids, strict=True)
    ]
    group = strategy.mesh["pp"].get_group()
    tie_groups, skip = _tie_groups(strategy, ties, cuts, ids, holders, pp, group)
    run = PipelineRun(
        stages, ids, count, options, group, tie_groups, strategy.device.torch, pp, holders
    )
    run.norm_skip = skip
    if strategy.rank == 0:
        shown = ", ".join(f"stage {s}: {cut.described(s)}" for s in range(count))
        print(f"gpukit: pipeline of {count} stage(s) over pp {pp} ({options.schedule}): {shown}")
    return Pipeline(stages, _viewed(cuts), run)


def _viewed(cuts: list[nn.Module]) -> nn.Module:
    """The stages' parameters under the whole model's names (see ``union``). Several stages'
    view is no fsdp root: it reshards theirs before its state is read or loaded, as a root
    does for itself (an evaluation may have left their full weights gathered)."""
    view = union(cuts)
    if len(cuts) > 1:

        def reshard(*_: Any) -> None:
            for cut in cuts:
                cut.reshard()  # type: ignore[operator]  # an fsdp root (sharded in _sharded)

        view.register_state_dict_pre_hook(reshard)
        view.register_load_state_dict_pre_hook(reshard)
    return view


def _blocks(stage: nn.Module, cut: Cut, index: int) -> list[Group]:
    """The blocks fsdp shards (checkpoints, compiles) one by one in ``stage``: those found as
    in a whole model, or where a stage holds a single one (no list of two to find), that one,
    unless it shares a parameter with the rest of the stage (then the root holds it)."""
    found = find_groups(stage)
    if found:
        return found
    lo, hi = cut.bounds[index]
    names = [f"{cut.prefix}.{k}" if cut.prefix else k for k in cut.keys[lo:hi]]
    held = [(n, stage.get_submodule(n)) for n in names]
    held = [(n, m) for n, m in held if any(True for _ in m.parameters())]
    if len(held) != 1:
        return []
    name, block = held[0]
    mine = {id(p) for p in block.parameters()}
    named = stage.named_parameters(remove_duplicate=False)
    others = {id(p) for n, p in named if not n.startswith(name + ".")}
    return [] if mine & others else [Group([name], [block])]


def _rewrapped(outer: nn.Module, inner: nn.Module) -> nn.Module:
    """``inner`` inside copies of the thin wrappers around ``outer``'s model (mixed
    precision's autocast), so each stage runs as the whole model would have."""
    if not getattr(outer, "gpukit_thin_wrapper", False):
        return inner
    (name, child), *_ = outer._modules.items()
    wrapper = outer.__class__.__new__(outer.__class__)
    wrapper.__dict__ = dict(outer.__dict__)
    wrapper._modules = {**outer._modules, name: _rewrapped(child, inner)}  # type: ignore[arg-type]
    return wrapper


def _tie_groups(
    strategy: FSDP,
    ties: list[tuple[list[str], list[int]]],
    cuts: list[nn.Module],
    ids: list[int],
    holders: list[int],
    pp: int,
    pp_group: Any,
) -> tuple[list[tuple[list[torch.Tensor], Any]], list[torch.Tensor]]:
    """For each parameter tied across stages: this rank's copies and the group of pipeline
    ranks that sum their gradients (None: all copies are here); and the copies the gradient
    norm leaves out (those not on the first stage holding it)."""
    found: list[tuple[list[torch.Tensor], Any]] = []
    skip: list[torch.Tensor] = []
    for names, stages in ties:
        if len(stages) < 2:
            continue  # within one stage: autograd sums it as in the whole model
        ranks = sorted({holders[s] for s in stages})
        group = None
        if len(ranks) == pp:
            group = pp_group
        elif len(ranks) > 1:
            group = _subgroup(strategy, ranks)
        copies: list[torch.Tensor] = []
        for cut, index in zip(cuts, ids, strict=True):
            named = dict(cut.named_parameters(remove_duplicate=False))
            for n in names:
                p = named.get(n)
                if p is not None and all(p is not c for c in copies):
                    copies.append(p)
                    if index != stages[0]:
                        skip.append(p)
        if copies or group is not None:
            found.append((copies, group))
    return found, skip


def _subgroup(strategy: FSDP, ranks: list[int]) -> Any:
    """The group of pipeline ranks ``ranks`` of this rank's pipeline: every rank makes every
    pipeline's (torch's new_group is collective), and keeps its own."""
    full = strategy.mesh.mesh  # pp outermost: one pipeline per other coordinate
    lines = full.reshape(full.shape[0], -1).T.tolist()
    mine = None
    for line in lines:
        made = dist.new_group([line[r] for r in ranks])
        if strategy.rank in (line[r] for r in ranks):
            mine = made
    return mine
