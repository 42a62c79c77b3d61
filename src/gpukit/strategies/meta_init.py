"""Models built on the meta device (``with torch.device("meta"): model = Net()``): shapes without
data, so that no rank ever holds the whole model in memory. ``rt.setup`` takes one: under fsdp it
shards first, then gives each rank's shards memory (``to_empty``) and initialises them; under
single and ddp it gives the whole model memory on the device and initialises it the same way.

How the weights are initialised, the same whatever the number of ranks:

- each module holding parameters or buffers of its own is initialised by its own
  ``reset_parameters()`` (the method torch's layers have), or by ``init(module)`` when the run
  gives ``init=``; children before their parents (as modules are built), a parameter tied across
  modules by the first one that holds it;
- the module's own tensors are swapped, for that call, for full-size CPU tensors, and the call
  draws from torch's CPU generator seeded from the run's seed and the module's name (the global
  generator is left as it was); each rank then keeps its shard of the result. The values thus do
  not depend on the rank count nor on the device, and memory holds one module's full tensors at a
  time, never the model's;
- a model whose root has ``init_weights()`` (torchtitan's pattern) and no ``init=`` is
  initialised by that method instead, called once on the materialised (sharded) model: random
  draws it makes on sharded parameters come from each rank's own generator, so they depend on
  the rank count;
- a module with parameters or buffers and neither ``reset_parameters`` nor ``init=`` is refused
  by name: ``to_empty`` leaves its memory uninitialised (a buffer computed in ``__init__``, such
  as a rotary cache, is lost too), and nothing could tell those values apart from real ones.

When a run resumes from a checkpoint, the checkpoint's weights replace these afterwards.
:func:`initialise` applies the same scheme to a model built normally, e.g. to compare.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError, warn_user

InitFn = Callable[[nn.Module], Any]


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in _tensors(module))


def any_not_meta(module: nn.Module) -> str | None:
    """The name of a tensor of ``module`` that is not on the meta device (a half-built model)."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return next((n for n, t in named if not t.is_meta), None)


@dataclass(frozen=True)
class MetaInit:
    """How a run initialises a meta-device model: the user's ``init`` (None: each module's
    ``reset_parameters``) and the run's ``seed`` (None: 0)."""

    init: InitFn | None = None
    seed: int | None = None

    def check(self, model: nn.Module) -> None:
        """Refuse, before any memory is taken, a model this scheme cannot fully initialise."""
        half = any_not_meta(model)
        if half is not None:
            raise ConfigError(
                f"rt.setup: the model is partly on the meta device but its {half} is not: "
                "build the whole model under torch.device('meta'), or none of it"
            )
        if self.init is not None or callable(getattr(model, "init_weights", None)):
            return
        for name, module in model.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            own += [n for n, _ in module.named_buffers(recurse=False)]
            if own and not callable(getattr(module, "reset_parameters", None)):
                where = f"{name}.{own[0]}" if name else own[0]
                raise ConfigError(
                    f"rt.setup: the model is on the meta device, and its module "
                    f"{name or '(root)'} ({type(module).__name__}) holds {where} but has no "
                    "reset_parameters() to initialise it after it gets memory (to_empty leaves "
                    "it uninitialised). Give the module a reset_parameters(), the root an "
                    "init_weights(), or the run an init= function (gk.Runtime(init=fn): "
                    "fn(module) initialises each module's own tensors)"
                )

    def not_used(self, model: nn.Module) -> None:
        """``model`` is not on the meta device: its weights stay as built, and ``init`` (which
        initialises meta models only) is not called on it; said when one was given."""
        if self.init is not None:
            warn_user(
                f"init= is not used for this {type(model).__name__}: it is not on the meta "
                "device, so its weights stay as built (init= initialises only models built "
                "under torch.device('meta')). Build it there to have init= initialise it, or "
                "drop init="
            )

    def materialise(self, model: nn.Module, device: torch.device) -> None:
        """Give ``model`` (sharded or not) memory on ``device`` and initialise it."""
        holders = _holders(model)
        model.to_empty(device=device)
        _tie_again(holders)
        init_weights = getattr(model, "init_weights", None)
        if self.init is None and callable(init_weights):
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(self.seed or 0)
                init_weights()
            return
        initialise(model, self.seed, self.init)


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Move every buffer of ``model`` to ``device`` (fsdp's offload keeps only parameters in
    CPU memory)."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)


def initialise(model: nn.Module, seed: int | None = None, init: InitFn | None = None) -> None:
    """Initialise every module of ``model`` holding tensors of its own, as a meta-device model
    is (see the module docstring): ``init(module)``, or ``module.reset_parameters()``, on
    full-size CPU tensors seeded from ``seed`` and the module's name, then copied into the
    model's tensors (each rank's shard of them, when sharded)."""
    done: set[int] = set()
    for name, module in _children_first(model):
        # The module's own tensors, swapped for full-size CPU ones during its init call.
        owned: list[dict[str, Any]] = [module._parameters, module._buffers]
        slots = [(d, k, v) for d in owned for k, v in d.items() if v is not None]
        todo = [(d, k, v) for d, k, v in slots if id(v) not in done]
        if not todo:
            continue
        reset = getattr(module, "reset_parameters", None)
        if init is None and not callable(reset):
            raise ConfigError(
                f"initialise: {name or '(root)'} ({type(module).__name__}) has no "
                "reset_parameters(): give init="
            )
        full = {k: _full_like(v) for _, k, v in slots}
        try:
            for d, k, _ in slots:
                d[k] = full[k]
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(_seed_of(seed, name))
                if init is not None:
                    init(module)
                elif callable(reset):
                    reset()
        finally:
            for d, k, v in slots:
                d[k] = v
        with torch.no_grad():
            for _, k, v in todo:
                keep_shard(v, full[k].detach())
                done.add(id(v))


def _holders(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The modules and names holding each parameter that more than one slot holds (a tie)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    return [held for held in slots.values() if len(held) > 1]


def _tie_again(holders: list[list[tuple[nn.Module, str]]]) -> None:
    """``to_empty`` gives each module its own new parameter, untying what was tied: tie the
    same slots again to the first one's."""
    for (first, first_name), *rest in holders:
        kept = first._parameters[first_name]
        for module, name in rest:
            module._parameters[name] = kept


def _full_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor of ``t``'s full (unsharded) shape, of its kind."""
    empty = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return (
        nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    )


def keep_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy into ``target`` its part of ``full``: all of it, or this rank's shard."""
    mesh = getattr(target, "device_mesh", None)
    if mesh is None:
        target.copy_(full)
        return
    from torch.distributed.tensor import distribute_tensor

    placements = getattr(target, "placements")  # noqa: B009  (a DTensor's)
    try:  # every rank holds the same full tensor: each keeps its shard, no communication
        part = distribute_tensor(full, mesh, placements, src_data_rank=None)
    except TypeError:  # torch < 2.5: no src_data_rank, rank 0's copy is scattered
        part = distribute_tensor(full, mesh, placements)
    getattr(target, "to_local")().copy_(part.to_local())  # noqa: B009


def _seed_of(seed: int | None, name: str) -> int:
    """A seed for module ``name`` from the run's: the same on every rank and rank count."""
    digest = hashlib.sha256(f"{seed or 0}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # within torch's seed range


def user_model(module: nn.Module) -> nn.Module:
    """The user's model inside gpukit's thin wrappers (mixed precision's autocast module)."""
    while getattr(module, "gpukit_thin_wrapper", False):
        module = next(module.children())
    return module


def _children_first(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for child_name, child in model.named_children():
        yield from _children_first(child, f"{prefix}.{child_name}" if prefix else child_name)
    yield prefix, model


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()
