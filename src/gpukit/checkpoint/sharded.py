"""Checkpoints of sharded (fsdp) models: every rank writes and reads its own shards.

Under fsdp no rank holds a whole weight or a whole optimizer state, and gathering them all on
rank 0 would need the memory fsdp saves. So the weights and optimizer states go through
``torch.distributed.checkpoint`` (DCP) into the checkpoint's ``sharded/`` folder: each rank
writes the shards it holds, names every value by its parameter's name (not by its position in
an optimizer), and DCP reads them back resharded for any number of ranks. Beside it rank 0
still writes ``model.safetensors`` from the full weights, for export and inspection (it loads
into an unsharded copy of the model), gathered one weight at a time (see ``export``), and
``state.pt`` with the progress, random states,
loaders and precision.

Every rank reads the checkpoint folder: it must be on a file system that every rank sees
(one machine, or a shared file system across machines). A load is all or nothing like any
other: DCP reads into new tensors laid out as the live ones, every rank checks what it read,
the ranks agree, and only then are the models and optimizers changed.

>>> import torch
>>> applies([torch.nn.Linear(2, 2)])
False
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
from torch import nn

from gpukit._util.text import described
from gpukit._util.tree import map_tensors
from gpukit.checkpoint import finite, snapshot
from gpukit.checkpoint.live import Precision, RunState, user_model
from gpukit.errors import ConfigError
from gpukit.strategies import Strategy
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies.float8 import plain_weight
from gpukit.strategies.fsdp import is_sharded

SHARDED = "sharded"  # the folder of the shards inside a checkpoint
LAYOUT = "sharded"  # state.pt's "layout" of a checkpoint written this way
_T = TypeVar("_T")


def applies(models: list[nn.Module]) -> bool:
    """Whether these models are saved as shards (some module inside one of them is fsdp's)."""
    return any(is_sharded(m) for m in models)


def agreed(strategy: Strategy, fn: Callable[[], _T]) -> _T:
    """``fn()`` on every rank, with its errors made every rank's: when it fails on one rank,
    it fails on all of them with that rank's message, instead of the others going on into a
    collective that rank will never join."""
    try:
        result, error = fn(), None
    except Exception as err:  # re-raised below, on this rank as itself
        result, error = None, err
    said = strategy.all_gather_object(None if error is None else str(error))
    if error is not None:
        raise error
    first = next((s for s in said if s is not None), None)
    if first is not None:
        raise ConfigError(first)
    return result  # type: ignore[return-value]


def full_state_dict(
    model: Any, state: RunState, strategy: Strategy, precision: Precision
) -> dict[str, torch.Tensor]:
    """What ``rt.full_state_dict(model)`` returns: ``model`` (None: the one model of
    ``state``) checked, then its :func:`full_weights`."""
    if model is None:
        if len(state.modules) != 1:
            raise ConfigError(
                f"rt.full_state_dict() without a model needs exactly one model set up, and "
                f"setup saw {len(state.modules)}: pass the model, rt.full_state_dict(model)"
            )
        model = state.modules[0]
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"rt.full_state_dict got {described(model)}: pass the model as rt.setup returned "
            "it, e.g. rt.full_state_dict(model)"
        )
    user = user_model(model, strategy, precision)
    return _snapshot(full_weights(user, strategy), user)


def _snapshot(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``weights`` with every tensor that shares memory with ``model``'s own copied, so that
    what the user keeps does not change as training goes on: on a GPU the move to the CPU
    copies, but on the CPU ``.cpu()`` (and one rank's gather) returns the live tensor."""
    live = set()
    for tensor in (*model.parameters(), *model.buffers()):
        local = plain_weight(cast(Any, tensor).to_local() if is_dtensor(tensor) else tensor)
        if local.device.type == "cpu":
            live.add(local.untyped_storage().data_ptr())
    return {
        k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in weights.items()
    }


def _from_every_stage(full: dict[str, torch.Tensor], strategy: Strategy) -> dict[str, torch.Tensor]:
    """``full`` with the weights only other ranks hold (pipeline stages) added, on rank 0
    (collective: every rank says which names it has, and sends those no lower rank has)."""
    names = strategy.all_gather_object(sorted(full))
    owner: dict[str, int] = {}
    for rank, listed in enumerate(names):
        for name in listed:
            owner.setdefault(name, rank)
    mine = {k: v for k, v in full.items() if owner[k] == strategy.rank and strategy.rank}
    merged = dict(full)
    for piece in strategy.all_gather_object(mine):
        merged.update(piece)
    return merged if strategy.rank == 0 else {}


def full_weights(model: nn.Module, strategy: Strategy) -> dict[str, torch.Tensor]:
    """The full weights of ``model`` as plain CPU tensors on rank 0; {} on the other ranks.
    Collective for a sharded model (every rank gives its shards)."""
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        # Pipeline stages: each rank gathers its own stage's weights (not rank 0 alone).
        staged = strategy.splits_model
        options = StateDictOptions(full_state_dict=True, cpu_offload=not staged)
        full = {
            # A view of several stages is no fsdp root: its shards are gathered here.
            k: plain_weight(cast(Any, v).full_tensor() if is_dtensor(v) else v).cpu()
            for k, v in get_model_state_dict(model, options=options).items()
            if isinstance(v, torch.Tensor)
        }
        if staged:
            return _from_every_stage(full, strategy)
        return full if strategy.rank == 0 else {}
    if strategy.rank != 0:
        return {}
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def save(
    folder: Path,
    models: list[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    strategy: Strategy,
) -> list[str]:
    """Write every rank's shards of the models and optimizers into ``folder/sharded``
    (collective; ``folder`` exists). Returns the non-finite optimizer values any rank holds
    (the same list on every rank); rank 0 checks the weights in full."""
    import torch.distributed.checkpoint as dcp

    model, optim = _state_dicts(models, optimizers)
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(folder / SHARDED))
    mine = finite.problems(_optimizer_entries(optim, strategy.rank))
    return sorted({line for rank in strategy.all_gather_object(mine) for line in rank})


def stage(models: list[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's shards of the models and optimizers copied to host memory, laid out as
    :func:`save` writes them, for :func:`write` to write while training changes the live
    ones (no collective; on a GPU the copies are enqueued: ``snapshot.wait_copies``)."""
    model, optim = _state_dicts(models, optimizers)
    return {"model": snapshot.tree(model), "optim": snapshot.tree(optim)}


def write(staged: dict[str, Any], folder: Path, rank: int, group: Any) -> list[str]:
    """Write what :func:`stage` copied into ``folder/sharded`` (collective over ``group``,
    every rank's thread together: DCP plans the files with it). Returns the non-finite
    optimizer values in this rank's shards."""
    import torch.distributed.checkpoint as dcp

    dcp.save(staged, checkpoint_id=str(folder / SHARDED), process_group=group)
    return finite.problems(_optimizer_entries(staged["optim"], rank))


def written_by(folder: Path, rank: int) -> list[Path]:
    """The shard files rank ``rank`` wrote into ``folder/sharded`` (DCP names them
    ``__<rank>_<n>.distcp``)."""
    return sorted((folder / SHARDED).glob(f"__{rank}_*.distcp"))


def prepare(
    path: Path,
    models: list[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    strategy: Strategy,
) -> Callable[[], None]:
    """Read the shards this rank needs from the checkpoint ``path`` into new tensors, check
    them (collective: every rank agrees), and return what puts them into the live models and
    optimizers. Nothing live changes before that is called. ConfigError when they do not fit
    or hold NaN or Inf."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # Reading the live optimizers' layout gives a fresh one a state (zero moments at step 0):
    # a load that is refused must leave it without one, as it was.
    stateless = [o for o in optimizers if not o.state]
    try:
        model, optim = _state_dicts(models, optimizers)
        # Pipeline stages: each rank holds some names; together they must be the checkpoint's.
        held = set(model)
        if strategy.splits_model:
            held = {n for names in strategy.all_gather_object(sorted(model)) for n in names}
        agreed(strategy, lambda: _check_layout(path, model, held))
        fresh = {"model": _fresh(model), "optim": _fresh(optim)}
        try:
            dcp.load(fresh, checkpoint_id=str(path / SHARDED))
        except Exception as err:
            raise ConfigError(
                f"checkpoint {path} does not fit what setup got (reading its shards: "
                f"{_first_line(err)}). Nothing was changed: build the models and optimizers as "
                "they were when it was saved, or start without resuming"
            ) from None
        entries = _optimizer_entries(fresh["optim"], strategy.rank)
        params = {n for n, _ in _root(models).named_parameters(remove_duplicate=False)}
        entries += [  # buffers may hold infinities on purpose: only NaN counts against them
            (f"{SHARDED}/", name, _local(value), name not in params)
            for name, value in fresh["model"].items()
        ]
        agreed(strategy, lambda: _refuse_non_finite(path, finite.problems(entries)))
    except Exception:
        for optimizer in stateless:
            optimizer.state.clear()
        raise

    def commit() -> None:
        set_state_dict(
            _root(models),
            optimizers,
            model_state_dict=fresh["model"],
            optim_state_dict=fresh["optim"],
        )

    return commit


def layout_mismatch(path: Path, saved: dict[str, Any], live_sharded: bool) -> str | None:
    """Why the checkpoint ``path`` (its ``state.pt`` read as ``saved``) cannot be loaded into
    this run, when one is sharded and the other is not; None when both are alike."""
    written_sharded = saved.get("layout") == LAYOUT
    if written_sharded == live_sharded:
        return None
    if written_sharded:
        return (
            f"checkpoint {path} was written by a sharded (fsdp) run: its optimizer state is in "
            f"shards under {SHARDED}/, which only an fsdp run reads, and this run does not shard "
            "its model. Nothing was changed: resume it with strategy='fsdp' (any number of "
            "ranks), or take the weights alone from its model.safetensors "
            "(safetensors.torch.load_model)"
        )
    return (
        f"checkpoint {path} was written by a run that did not shard its model (full weights "
        "in model.safetensors, optimizer state in state.pt), and this run shards it with fsdp, "
        "which resumes only from checkpoints an fsdp run wrote. Nothing was changed: resume it "
        "with the strategy that wrote it (ddp or single), or load its weights alone into the "
        "model before rt.setup (safetensors.torch.load_model) and start a new run"
    )


def _state_dicts(
    models: list[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The models' and optimizers' state dicts as DCP lays them out: weights by name, each
    optimizer state by its parameter's name, shards as DTensors."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    root = _root(models)
    if not optimizers:
        return dict(get_model_state_dict(root)), {}
    model, optim = get_state_dict(root, optimizers)
    return dict(model), dict(optim)


def _root(models: list[nn.Module]) -> nn.Module:
    # Several models: one container, so one optimizer may span them ("0.fc.weight", ...).
    return models[0] if len(models) == 1 else nn.ModuleList(models)


def _check_layout(path: Path, model: dict[str, Any], held: set[str]) -> None:
    """The saved weights' names, shapes and dtypes against the live ones, from the metadata
    DCP wrote (nothing large is read); ``held``: the names the model has on any rank."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path / SHARDED)).read_metadata().state_dict_metadata
    except Exception as err:
        raise ConfigError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {_first_line(err)}). "
            "Nothing was changed"
        ) from None
    saved = {k[len("model.") :]: v for k, v in metadata.items() if k.startswith("model.")}
    found = []
    for name, value in model.items():
        shape = tuple(value.shape)
        if name not in saved:
            found.append(f"{name}: not in the checkpoint, model {shape}")
            continue
        kept_shape, kept_dtype = _described(saved[name])
        if kept_shape not in (None, shape):
            found.append(f"{name}: checkpoint {kept_shape}, model {shape}")
        elif kept_dtype not in (None, value.dtype):
            found.append(f"{name}: checkpoint {kept_dtype}, model {value.dtype}")
    found += [
        f"{k}: checkpoint {_described(v)[0]}, not in the model"
        for k, v in saved.items()
        if k not in held
    ]
    if found:
        more = f"; and {len(found) - 5} more" if len(found) > 5 else ""
        raise ConfigError(
            f"checkpoint {path} does not fit what setup got ({'; '.join(found[:5])}{more}). "
            "Nothing was changed: build the models and optimizers as they were when it was "
            "saved, or start without resuming"
        )


def _described(metadata: Any) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    """The shape and dtype DCP's metadata gives for a saved value (None: not a tensor)."""
    size = getattr(metadata, "size", None)
    dtype = getattr(getattr(metadata, "properties", None), "dtype", None)
    return (tuple(size) if size is not None else None), dtype


def _refuse_non_finite(path: Path, bad: list[str]) -> None:
    if bad:
        raise ConfigError(
            f"checkpoint {path} holds non-finite values ({'; '.join(bad[:5])}). Nothing was "
            "changed: resume from an earlier checkpoint"
        )


def _optimizer_entries(optim: dict[str, Any], rank: int) -> list[finite.Entry]:
    """This rank's shards of every optimizer state tensor and number, by parameter name."""
    entries: list[finite.Entry] = []
    for name, kept in optim.get("state", {}).items():
        for key, value in kept.items():
            label = f"optimizer {key} of {name} (rank {rank}'s shard)"
            entries += finite.state_entries(f"{SHARDED}/", label, _local(value))
    return entries


def _local(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


def _fresh(tree: Any) -> Any:
    """``tree`` with every tensor replaced by a new one laid out alike (a DTensor's shards
    placed as its), for DCP to read into without touching the live ones."""
    return map_tensors(tree, torch.empty_like)


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines or [type(err).__name__])[0][:300]
