"""One file of the program's own choosing: ``rt.save("run.pt", state)`` and
``rt.load("run.pt", state)``, as a Lightning Fabric program writes ``fabric.save`` and
``fabric.load``.

``state`` is a dict of the program's choosing: models, optimizers, schedulers and any object
with ``state_dict()``/``load_state_dict()``, tensors and plain values (numbers, strings, lists,
dicts). The file holds the same dict with each object replaced by its full, unsharded state
dict (under ddp the user's model without its wrapper; under fsdp every weight and optimizer
state gathered), every tensor on the CPU, so it loads on any device and any number of ranks.
Rank 0 writes it, under a temporary name renamed into place: a reader sees the previous file or
the new one, never half of one. It holds plain data only and is read with
``weights_only=True``: loading it never runs code.

Unlike a checkpoint folder (:mod:`gpukit.checkpoint`), it holds what the program gave and
nothing more: no loader positions, random states or step counters, and ``resume="auto"`` does
not look for it.

>>> import tempfile, torch, gpukit as gk
>>> rt = gk.Runtime(devices="cpu")
>>> model = rt.setup(torch.nn.Linear(2, 1))
>>> path = tempfile.mkdtemp() + "/run.pt"
>>> rt.save(path, {"model": model, "epoch": 3}).name
'run.pt'
>>> rt.load(path, {"model": model})
{'epoch': 3}
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit._util import files
from gpukit._util.text import type_name
from gpukit._util.tree import map_tensors
from gpukit.checkpoint.live import Precision, RunState, user_model
from gpukit.checkpoint.plain import not_plain, saved_state
from gpukit.checkpoint.sharded import full_weights
from gpukit.errors import ConfigError, OutputWriteError
from gpukit.strategies import Strategy
from gpukit.strategies.fsdp import is_sharded

# The names a file of this form is given (Fabric's examples, torch.save's habits): a path so
# named without a state is a file meant, not a checkpoint folder.
SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".tar")


@dataclass(frozen=True)
class Run:
    """What a file is saved from and loaded into: the models ``rt.setup`` saw (``state``),
    and the ``strategy`` and ``precision`` that wrap them."""

    state: RunState
    strategy: Strategy
    precision: Precision


def named_as_file(path: str | Path) -> bool:
    """Whether ``path``'s name ends as a file of this form does (``.pt``, ``.ckpt``...).

    >>> named_as_file("run.pt"), named_as_file("ckpt")
    (True, False)
    """
    return Path(path).suffix.lower() in SUFFIXES


def save(path: Path, state: Mapping[str, Any], run: Run) -> None:
    """Write ``state`` (see the module) to the file ``path``. Collective: every rank calls it
    (under fsdp every rank gives its shards), rank 0 writes, and a write the disk refused is
    raised on every rank."""
    strategy = run.strategy
    # Every rank gathers its shards and checks its own state; what one rank refuses is raised
    # on all of them before rank 0 writes, never a rank left waiting for one that stopped.
    saved, problem = _saved(state, run)
    _agree(strategy, problem)
    error: Exception | None = None
    if strategy.rank == 0:
        try:
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            files.make_folder(path.parent, option="rt.save's path")
            files.write_atomic(path, buffer.getvalue(), sync=True, option="rt.save's path")
        except OutputWriteError as err:
            error = err
    # Every rank waits for the write: a load right after reads the new file.
    said = strategy.all_gather_object(None if error is None else str(error))
    if error is not None:
        raise error
    if said[0] is not None:
        raise OutputWriteError(said[0])


def load(
    path: Path,
    state: Mapping[str, Any] | None,
    run: Run,
) -> dict[str, Any]:
    """Read the file ``path`` on every rank. Without ``state``: its dict. With ``state``: its
    objects loaded in place and its plain values replaced by the file's; returns the file's
    items that ``state`` does not name. Everything is checked before anything changes; a
    problem on any rank is raised on every rank."""
    if state is not None and not isinstance(state, Mapping):
        raise ConfigError(
            f"rt.load({str(path)!r}, state) got a state of {type_name(state)}: give a dict "
            "of what to fill, e.g. rt.load(path, {'model': model, 'optimizer': optimizer})"
        )
    try:
        loaded, problem = _read(path), None
        if state is not None:
            problem = _mismatch(path, loaded, state, run)
    except ConfigError as err:
        loaded, problem = None, str(err)
    _agree(run.strategy, problem)
    assert isinstance(loaded, dict)
    if state is None:
        return loaded
    for name, obj in state.items():
        value = loaded.pop(name)
        if isinstance(obj, nn.Module):
            _load_module(user_model(obj, run.strategy, run.precision), value)
        elif isinstance(obj, torch.optim.Optimizer):
            _load_optimizer(obj, value, run)
        elif _stateful(obj):
            obj.load_state_dict(value)
        elif isinstance(obj, torch.Tensor) and isinstance(value, torch.Tensor):
            state[name] = value.to(obj.device)  # type: ignore[index]
        else:
            state[name] = value  # type: ignore[index]
    return loaded


def _agree(strategy: Strategy, problem: str | None) -> None:
    """Raise the first rank's ``problem`` as a ConfigError on every rank, if any rank has one.
    Collective: every rank calls it, with its problem or None."""
    said = strategy.all_gather_object(problem)
    first = next((s for s in said if s is not None), None)
    if first is not None:
        raise ConfigError(first)


def _saved(state: Mapping[str, Any], run: Run) -> tuple[dict[str, Any], str | None]:
    """``state`` as the file holds it, and the first entry the file cannot hold, or None. Every
    entry is gathered even after a refused one: under fsdp a gather is collective, and the
    other ranks, which may have refused nothing, are gathering it too."""
    if not isinstance(state, Mapping):
        return {}, (
            f"rt.save(path, state) got a state of {type_name(state)}: give a dict of what to "
            "save, e.g. rt.save('run.pt', {'model': model, 'optimizer': optimizer})"
        )
    saved: dict[str, Any] = {}
    problem: str | None = None
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            user = user_model(obj, run.strategy, run.precision)
            value: Any = full_weights(user, run.strategy) if is_sharded(user) else user.state_dict()
        elif isinstance(obj, torch.optim.Optimizer):
            value = _optimizer_state(obj, run)
        elif _stateful(obj):
            value = saved_state(obj)
        else:
            value = obj
        where = not_plain(value, f"[{name!r}]")
        if not isinstance(name, str):
            problem = problem or (
                f"rt.save(path, state): the key {name!r} is a {type_name(name)}: name each "
                "entry with a string, e.g. {'model': model}"
            )
        elif where is not None:
            problem = problem or (
                f"rt.save(path, state): state{where}, which a file read back without running "
                "code cannot hold: give tensors, numbers, strings, lists and dicts of them, or "
                "objects with state_dict()/load_state_dict() (a model, an optimizer, a scheduler)"
            )
        else:
            saved[name] = map_tensors(value, lambda t: t.detach().cpu())
    return saved, problem


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def _sharded_owner(optimizer: torch.optim.Optimizer, run: Run) -> nn.Module | None:
    """The fsdp-sharded model set up whose parameters ``optimizer`` steps, if any: its state
    is gathered and scattered through that model (named by parameter, not by position)."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in run.state.modules:
        user = user_model(module, run.strategy, run.precision)
        if is_sharded(user) and any(id(p) in stepped for p in user.parameters()):
            return user
    return None


def _optimizer_state(optimizer: torch.optim.Optimizer, run: Run) -> Any:
    owner = _sharded_owner(optimizer, run)
    if owner is None:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(owner, optimizer, options=options)


def _load_optimizer(optimizer: torch.optim.Optimizer, value: Any, run: Run) -> None:
    owner = _sharded_owner(optimizer, run)
    if owner is None:
        optimizer.load_state_dict(value)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not value.get("state"):
        # Nothing kept per parameter (SGD without momentum, before a step): torch's loader
        # finds no tensor to place and fails; the groups' settings are all there is to load.
        groups = value.get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            raise ConfigError(
                f"rt.load: the file's optimizer has {len(groups)} parameter group(s), the "
                f"optimizer given {len(optimizer.param_groups)}; nothing was changed"
            )
        for live, kept in zip(optimizer.param_groups, groups, strict=True):
            live.update({k: v for k, v in kept.items() if k != "params"})
        return
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(owner, optimizer, value, options=options)


def _load_module(model: nn.Module, value: dict[str, Any]) -> None:
    if not is_sharded(model):
        model.load_state_dict(value)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, value, options=StateDictOptions(full_state_dict=True))


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"rt.load({str(path)!r}): no such file on this rank: give the file rt.save(path, "
            "state) wrote (every rank must see it: one machine, or a shared file system)"
        )
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file, a pickle of objects: said as such, never run
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"rt.load({str(path)!r}): the file cannot be read as plain data ({first[:200]}); "
            "nothing was changed: give a file written by rt.save(path, state) or torch.save "
            "of tensors and plain values"
        ) from err
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"rt.load({str(path)!r}): the file holds a {type_name(loaded)}, not a dict of "
            "named entries; read it with torch.load, or write it with rt.save(path, state)"
        )
    return loaded


def _mismatch(
    path: Path,
    loaded: dict[str, Any],
    state: Mapping[str, Any],
    run: Run,
) -> str | None:
    """What keeps ``loaded`` from filling ``state``, or None: a name it lacks, a model's
    weights that differ in names or shapes, an optimizer's groups that differ in number or
    size. Found before anything is loaded: torch's loaders fail halfway, after the models
    before them have changed."""
    missing = [name for name in state if name not in loaded]
    if missing:
        return (
            f"rt.load({str(path)!r}, state): the file has no {', '.join(map(repr, missing))} "
            f"(it holds {', '.join(map(repr, loaded)) or 'nothing'}); nothing was changed: "
            "leave those out of state, or load the file they were saved in"
        )
    for name, obj in state.items():
        if isinstance(obj, nn.Module):
            found = _weights_mismatch(loaded[name], user_model(obj, run.strategy, run.precision))
            if found:
                return (
                    f"rt.load({str(path)!r}, state): {name!r} does not fit the model given: "
                    f"{found}; nothing was changed: give the model the file was saved from"
                )
        elif (_stateful(obj) or isinstance(obj, torch.optim.Optimizer)) and not isinstance(
            loaded[name], dict
        ):
            return (
                f"rt.load({str(path)!r}, state): {name!r} is a {type_name(loaded[name])} in "
                f"the file, not the state of the {type_name(obj)} given; nothing was changed"
            )
        elif isinstance(obj, torch.optim.Optimizer):
            found = _optimizer_mismatch(loaded[name], obj)
            if found:
                return (
                    f"rt.load({str(path)!r}, state): {name!r} does not fit the optimizer "
                    f"given: {found}; nothing was changed: give an optimizer made as the "
                    "saved one was (the same parameter groups, in the same order)"
                )
    return None


def _weights_mismatch(saved: Any, model: nn.Module) -> str | None:
    if not isinstance(saved, dict):
        return f"the file holds a {type_name(saved)}, not weights"
    live = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    kept = {k: tuple(v.shape) for k, v in saved.items() if isinstance(v, torch.Tensor)}
    lacking, extra = sorted(live.keys() - kept.keys()), sorted(kept.keys() - live.keys())
    if lacking or extra:
        return f"missing {lacking[:5]}, unexpected {extra[:5]}"
    for k, shape in live.items():
        if shape != kept[k]:
            return f"{k}: file {kept[k]}, model {shape}"
    return None


# torch's optimizers whose state per parameter is the parameter's shape or a 0-d count: a
# saved state of another shape is another model's. Others (LBFGS, Adafactor) keep other shapes.
_ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def _optimizer_mismatch(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> str | None:
    """Where the file's optimizer state does not fit ``optimizer``: the groups' count, each
    group's parameter count, and the shape of each state tensor kept for a parameter (against
    the live optimizer's state where it has one, else the parameter's own shape)."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        return "the file holds no parameter groups"
    live_groups = optimizer.param_groups
    if len(groups) != len(live_groups):
        return f"the file has {len(groups)} parameter group(s), the optimizer {len(live_groups)}"
    kept = saved.get("state")
    kept = kept if isinstance(kept, dict) else {}
    for index, (group, live) in enumerate(zip(groups, live_groups, strict=True)):
        if len(group["params"]) != len(live["params"]):
            return (
                f"group {index} holds {len(group['params'])} parameter(s) in the file, "
                f"{len(live['params'])} in the optimizer"
            )
        for key, param in zip(group["params"], live["params"], strict=True):
            found = _state_shape_mismatch(kept.get(key), optimizer, param)
            if found:
                return f"group {index}, parameter {key!r}: {found}"
    return None


def _state_shape_mismatch(
    saved: Any, optimizer: torch.optim.Optimizer, param: torch.Tensor
) -> str | None:
    if not isinstance(saved, dict):
        return None
    live = optimizer.state.get(param, {})
    for name, value in saved.items():
        if not isinstance(value, torch.Tensor):
            continue
        current = live.get(name)
        if isinstance(current, torch.Tensor):
            expected: tuple[int, ...] | None = tuple(current.shape)
        elif type(optimizer) in _ELEMENTWISE and value.dim() > 0:
            expected = tuple(param.shape)
        else:
            expected = None
        if expected is not None and tuple(value.shape) != expected:
            return f"{name!r} is {tuple(value.shape)} in the file, {expected} here"
    return None
