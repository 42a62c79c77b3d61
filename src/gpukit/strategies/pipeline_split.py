"""A model cut into pipeline stages that keep the whole model's parameter names.

The cut falls between the entries of one ``nn.Sequential`` or ``nn.ModuleList``: the model's
repeated blocks (``_groups.find_blocks``), shared as evenly as they go (earlier stages take
one more where they do not divide), or the entries the user names as the first of each stage
after the first (``pp_split=["blocks.4"]``: stage 1 starts at ``blocks.4``). Each stage is a
copy of the whole model with what it does not run taken out, as torchtitan does it: the
blocks of other stages are deleted from the list (the others keep their names: a Sequential
runs what it holds), and the modules around the list are kept where the forward needs them:
those registered before it on the first stage, those after it on the last, modules without
parameters (dropout, rotary tables) on every stage; elsewhere they are ``None``. So a stage's
``state_dict`` has the names of the whole model's, and checkpoints move between pipeline
layouts. A model other than a Sequential must let its forward skip what is ``None`` (gpukit's
gpt and llama workloads do: a later stage gets hidden states instead of token ids).

>>> from torch import nn
>>> model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
>>> cut = Cut.of(model, 2, None)
>>> [sorted(stage_module(model, cut, s).state_dict()) for s in range(2)]
[['0.bias', '0.weight', '1.bias', '1.weight'], ['2.bias', '2.weight', '3.bias', '3.weight']]
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

from torch import nn

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies._groups import find_blocks


@dataclass(frozen=True)
class Cut:
    """Where the stages fall: ``prefix`` names the list (``""``: the model itself), ``keys``
    its entries in order, ``bounds[s]`` the entries ``[lo, hi)`` of stage ``s``."""

    prefix: str
    keys: tuple[str, ...]
    bounds: tuple[tuple[int, int], ...]

    @staticmethod
    def of(model: nn.Module, stages: int, split: list[str] | None) -> Cut:
        """The cut of ``model`` into ``stages`` stages, at ``split`` or between its blocks."""
        if split is not None:
            return _at_points(model, stages, split)
        found = find_blocks(model)
        if found is None:
            raise ConfigError(
                f"pipeline parallel: {type(model).__name__} has no list of repeated blocks to "
                "cut into stages (an nn.Sequential or nn.ModuleList of one block class): name "
                "where each stage after the first starts, e.g. Parallel(pp=2, "
                "pp_split=['layers.4'])"
            )
        prefix, blocks = found
        if len(blocks) < stages:
            raise ConfigError(
                f"pipeline parallel: {stages} stage(s) but {type(model).__name__} has "
                f"{len(blocks)} block(s) in {prefix or 'the model'}: each stage needs at least "
                "one; use fewer stages (pp, pp_stages_per_rank) or a deeper model"
            )
        container = model.get_submodule(prefix) if prefix else model
        keys = tuple(k for k, c in container._modules.items() if c is not None)
        base, extra = divmod(len(keys), stages)
        bounds, lo = [], 0
        for s in range(stages):
            hi = lo + base + (1 if s < extra else 0)
            bounds.append((lo, hi))
            lo = hi
        return Cut(prefix, keys, tuple(bounds))

    def described(self, stage: int) -> str:
        lo, hi = self.bounds[stage]
        where = f"{self.prefix}." if self.prefix else ""
        first, last = self.keys[lo], self.keys[hi - 1]
        return f"{where}{first}" if lo == hi - 1 else f"{where}{first}..{last}"


def _at_points(model: nn.Module, stages: int, split: list[str]) -> Cut:
    if not isinstance(split, (list, tuple)) or not all(isinstance(s, str) for s in split):
        raise ConfigError(
            f"pp_split={described(split)}: give a list of module names, the first module of "
            "each stage after the first, e.g. ['blocks.4']"
        )
    if len(split) != stages - 1:
        raise ConfigError(
            f"pp_split={list(split)} names {len(split)} point(s), which make {len(split) + 1} "
            f"stage(s), but the layout has {stages}: give {stages - 1} point(s)"
        )
    parents = {name.rpartition(".")[0] for name in split}
    prefix = next(iter(parents))
    container = model.get_submodule(prefix) if prefix else model
    if len(parents) != 1 or not isinstance(container, (nn.Sequential, nn.ModuleList)):
        raise ConfigError(
            f"pp_split={list(split)}: the points must be entries of one nn.Sequential or "
            f"nn.ModuleList (the stages run its entries in order); got "
            f"{', '.join(sorted(p or '(the model)' for p in parents))}"
        )
    keys = tuple(k for k, c in container._modules.items() if c is not None)
    where = [name.rpartition(".")[2] for name in split]
    unknown = [w for w in where if w not in keys]
    if unknown:
        raise ConfigError(
            f"pp_split: {prefix or 'the model'} has no entry {', '.join(unknown)}; its entries "
            f"are {', '.join(keys)}"
        )
    starts = [keys.index(w) for w in where]
    if starts[0] == 0 or any(b <= a for a, b in itertools.pairwise(starts)):
        raise ConfigError(
            f"pp_split={list(split)}: give the points in order, after the list's first entry "
            "(each starts a stage that is not empty)"
        )
    edges = [0, *starts, len(keys)]
    return Cut(prefix, keys, tuple((edges[i], edges[i + 1]) for i in range(stages)))


def stage_module(model: nn.Module, cut: Cut, stage: int) -> nn.Module:
    """A copy of ``model`` holding what stage ``stage`` runs (see the module docstring)."""
    last = len(cut.bounds) - 1
    copied = copy.deepcopy(model)
    container = copied.get_submodule(cut.prefix) if cut.prefix else copied
    lo, hi = cut.bounds[stage]
    for i, key in enumerate(cut.keys):
        if not lo <= i < hi:
            del container._modules[key]
    # Around the list, level by level along its path: before it, the first stage's; after
    # it, the last stage's.
    parts = cut.prefix.split(".") if cut.prefix else []
    holder: nn.Module = copied
    for part in parts:
        names = list(holder._modules)
        at = names.index(part)
        for j, name in enumerate(names):
            child = holder._modules[name]
            if j == at or child is None or not any(True for _ in child.parameters()):
                continue
            keep = stage == 0 if j < at else stage == last
            if not keep:
                setattr(holder, name, None)
        for name in list(holder._parameters):
            if stage != 0:  # a parameter of the model itself: the first stage's
                setattr(holder, name, None)
        holder = holder._modules[part]  # type: ignore[assignment]  # on the path: a module
    return copied


def holding(model: nn.Module, cut: Cut, name: str) -> list[int]:
    """The stages whose module holds the parameter ``name`` of ``model`` (as
    :func:`stage_module` keeps it)."""
    last = len(cut.bounds) - 1
    parts = cut.prefix.split(".") if cut.prefix else []
    comps = name.split(".")
    holder: nn.Module = model
    for i, part in enumerate(parts):
        if comps[i] == part:
            holder = holder._modules[part]  # type: ignore[assignment]  # on the path
            continue
        if comps[i] in holder._parameters:
            return [0]
        names = list(holder._modules)
        return [0] if names.index(comps[i]) < names.index(part) else [last]
    index = cut.keys.index(comps[len(parts)])
    return [s for s, (lo, hi) in enumerate(cut.bounds) if lo <= index < hi]


def tied_names(model: nn.Module) -> list[list[str]]:
    """Names under which one parameter appears more than once (a head tied to its
    embedding): after the cut, each stage holds its own copy, summed and kept equal."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


class StagesView(nn.Module):
    """Several stages' modules seen as one (see :func:`union`); ``stages`` holds them."""

    stages: tuple[nn.Module, ...] = ()


def union(modules: list[nn.Module], top: bool = True) -> nn.Module:
    """One module whose ``state_dict`` holds every name of ``modules`` (stages of one model
    on one rank), sharing their parameters: what checkpoints read and load."""
    if len(modules) == 1:
        return modules[0]
    view = StagesView() if top else nn.Module()
    if top:
        view.__dict__["stages"] = tuple(modules)  # not children: their names are the view's
    children: dict[str, list[nn.Module]] = {}
    for m in modules:
        for name, p in m._parameters.items():
            if p is not None:
                view._parameters[name] = p
        for name, b in m._buffers.items():
            if b is not None:
                view._buffers[name] = b
                if name in m._non_persistent_buffers_set:
                    view._non_persistent_buffers_set.add(name)
        for name, child in m._modules.items():
            if child is not None and all(child is not c for c in children.get(name, [])):
                children.setdefault(name, []).append(child)
    for name, found in children.items():
        view._modules[name] = union(found, top=False)
    return view
