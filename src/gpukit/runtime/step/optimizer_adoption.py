"""Optimizers built before ``rt.setup`` train the parameters setup put in place.

A strategy that shards a model (fsdp) replaces its parameters with new ones. An optimizer
built from ``model.parameters()`` before that still holds the old ones: it would step tensors
the model no longer uses, and the model would silently not train. ``adopt`` points such an
optimizer's groups at the new parameters, and lays any state it already has (a loaded
``state_dict``) out as its parameter is. ``StaleOptimizers`` remembers the replaced parameters,
so an optimizer that setup never saw is refused at its first step instead of doing nothing.

>>> import torch
>>> old = {"w": torch.nn.Parameter(torch.ones(2))}
>>> new = {"w": torch.nn.Parameter(torch.ones(2))}
>>> opt = torch.optim.SGD(old.values(), lr=0.1)
>>> len(adopt(old, new, [opt])), opt.param_groups[0]["params"][0] is new["w"]
(1, True)
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor


def parameters(module: object) -> dict[str, torch.Tensor]:
    """``module``'s parameters by name, shared ones under each name (none for what is not a
    module: the strategy refuses it, with the reason)."""
    if not isinstance(module, torch.nn.Module):
        return {}
    return dict(module.named_parameters(remove_duplicate=False))


def adopt(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    optimizers: list[torch.optim.Optimizer],
) -> list[torch.Tensor]:
    """Point ``optimizers`` from each parameter of ``before`` to the one of the same name in
    ``after`` (where setup replaced it); returns the replaced parameters."""
    # old -> its new parameters: one, or one per copy where setup split a tied parameter
    # (pipeline stages on one rank each hold their own copy, kept equal by the strategy).
    moved: dict[int, list[torch.Tensor]] = {}
    for name, old in before.items():
        new = after.get(name)
        if new is not None and new is not old:
            copies = moved.setdefault(id(old), [])
            if all(new is not c for c in copies):
                copies.append(new)
    # A parameter under none of its names any more lives on another rank (a pipeline stage
    # holds part of the model): this rank's optimizers leave it.
    kept = {id(p) for p in after.values()}
    gone = {id(old) for old in before.values() if id(old) not in moved and id(old) not in kept}
    if not moved and not (gone and after):
        return []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            # In place: an optimizer may hold this very list (LBFGS keeps it as _params).
            group["params"][:] = [
                n for p in group["params"] if id(p) not in gone for n in moved.get(id(p), [p])
            ]
        for param in list(optimizer.state):
            if id(param) in gone:
                del optimizer.state[param]
                continue
            if id(param) in moved:
                state = optimizer.state.pop(param)
                for i, new in enumerate(moved[id(param)]):
                    laid = {k: _laid_out(v, param, new) for k, v in state.items()}
                    if i:  # each copy steps its own moments
                        laid = {k: _own(v) for k, v in laid.items()}
                    optimizer.state[new] = laid
    olds: dict[int, torch.Tensor] = {}
    for _name, old in before.items():
        if id(old) in moved:
            olds.setdefault(id(old), old)
    return list(olds.values())


def _own(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _laid_out(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    """A state tensor shaped as its parameter, placed as the new parameter is (sharded)."""
    if not isinstance(value, torch.Tensor) or value.shape != old.shape or value.dim() == 0:
        return value
    if is_dtensor(new):
        from torch.distributed.tensor import distribute_tensor

        # The ignore: is_dtensor(new) holds, but Tensor's stubs do not know DTensor's fields.
        mesh, placements = new.device_mesh, new.placements  # type: ignore[attr-defined]
        return distribute_tensor(value.to(new.device), mesh, placements)
    return value.to(new.device)


class StaleOptimizers:
    """The parameters setup replaced, to refuse an optimizer that still holds them."""

    def __init__(self) -> None:
        self._replaced: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        self._checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def note(self, replaced: list[torch.Tensor]) -> None:
        for p in replaced:
            self._replaced[id(p)] = p

    def replaced(self, param: torch.Tensor) -> bool:
        """Whether setup replaced ``param`` (a model's parameter before fsdp sharded it)."""
        return self._replaced.get(id(param)) is param

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Once per optimizer (its first step): refuse it if it holds replaced parameters."""
        if not self._replaced or optimizer in self._checked:
            return
        self._checked.add(optimizer)
        stale = sum(
            1
            for group in optimizer.param_groups
            for p in group["params"]
            if self._replaced.get(id(p)) is p
        )
        if stale:
            raise ConfigError(
                f"this optimizer holds {stale} parameter(s) the model had before rt.setup "
                "sharded it: stepping it would change tensors the model no longer uses, and "
                "the model would not train. Pass the optimizer to rt.setup (model, optimizer "
                "= rt.setup(model, optimizer)), or build it after rt.setup from "
                "model.parameters()"
            )


def refuse_foreign(
    optimizers: list[torch.optim.Optimizer],
    models: Sequence[Mapping[str, torch.Tensor]],
    stale: StaleOptimizers | None = None,
) -> None:
    """Refuse, before setup changes anything, an optimizer none of whose parameters is one of
    ``models``' (those set up and the one being set up: ``rt.setup(model_a,
    SGD(model_b.parameters()))``): stepping it would train nothing the Runtime runs. One
    parameter of a model is enough: an optimizer may also hold parameters of its own (a
    learnable loss weight), which are left as they are. A parameter ``stale`` saw replaced
    (fsdp's) counts as its model's: that optimizer gets ``StaleOptimizers``' own message.

    >>> model = torch.nn.Linear(1, 1)
    >>> refuse_foreign([torch.optim.SGD(torch.nn.Linear(1, 1).parameters())], [parameters(model)])
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: the optimizer SGD holds 2 parameter(s), and none is a parameter ...
    """
    known = {id(p) for names in models for p in names.values()}

    def belongs(p: torch.Tensor) -> bool:
        return id(p) in known or (stale is not None and stale.replaced(p))

    for optimizer in optimizers:
        held = [p for group in optimizer.param_groups for p in group["params"]]
        if held and not any(belongs(p) for p in held):
            raise ConfigError(
                f"the optimizer {type(optimizer).__name__} holds {len(held)} parameter(s), and "
                "none is a parameter of a model rt.setup saw: stepping it would train nothing "
                "the Runtime runs (was it built from another model's parameters?). Build it "
                "from the model you set up, e.g. rt.setup(model, SGD(model.parameters())), or "
                "set up its model first: rt.setup(other_model, optimizer)"
            )
