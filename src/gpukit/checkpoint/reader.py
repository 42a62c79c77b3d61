"""Loading a checkpoint all or nothing: every file is verified against its manifest, read and
checked against the live models, optimizers and precision first; only then is anything
changed. Any problem is a ConfigError, and the model and optimizer are left exactly as they
were.
"""

from __future__ import annotations

import pickle
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from safetensors.torch import load_file

from gpukit.checkpoint import files, finite, objects, sharded
from gpukit.checkpoint.fit import (
    model_mismatches,
    optimizer_entries,
    optimizer_mismatches,
    parameter_names,
    precision_mismatches,
    user_models,
    weights_name,
)
from gpukit.checkpoint.live import Loader, Precision, RunState
from gpukit.errors import ConfigError, warn_user
from gpukit.strategies import Strategy

_KEYS = ("format", "epoch", "step", "micro_step", "loaders", "optimizers", "precision", "rng")
_SHOWN = 5  # mismatches listed in a message; the rest are counted
# Lines of torch's own refusal that address its caller, not ours: never shown.
_TORCH_ADVICE = ("weights_only", "re-running", "weightsunpickler", "file an issue", "documentation")


def load(
    directory: Path,
    state: RunState,
    strategy: Strategy,
    precision: Precision,
    accumulate: int = 1,
) -> dict[str, int]:
    """Restore the newest good checkpoint under ``directory`` (or the checkpoint folder
    ``directory``) into ``state`` (after ``setup``); returns its epoch and step. Nothing
    changes unless everything fits. Users call it through the Runtime::

        rt.load("ckpt")                      # the newest good one: {"epoch": 3, "step": 40}
        rt.load("ckpt/step-00000032")        # that one
    """
    models = user_models(state, strategy, precision)
    shards = sharded.applies(models)
    if shards:  # every rank reads: the ranks must agree on what, and on any problem
        path, saved = sharded.agreed(strategy, lambda: _read_checked(directory, precision, True))
        _refuse(path, objects.mismatches(saved, state))
        restore_shards = sharded.prepare(path, models, state.optimizers, strategy)

        def restore() -> None:
            restore_shards()
            for i in saved.get("fresh_optimizers", []):  # saved before their first step
                state.optimizers[i].state.clear()
    else:
        path, saved = _read_checked(directory, precision, False)
        weights = _read_weights(path, len(models))
        _check(path, saved, weights, models, state, precision)

        def restore() -> None:
            with torch.no_grad():
                for model, tensors in zip(models, weights, strict=True):
                    # Not strict: a tied weight is in the file once and fills both its names.
                    model.load_state_dict(tensors, strict=False)
            for optimizer, kept in zip(state.optimizers, saved["optimizers"], strict=True):
                optimizer.load_state_dict(kept)

    ranks = saved["rng"]
    if len(ranks) != strategy.world_size:
        warn_user(
            f"checkpoint {path} was written by {len(ranks)} rank(s), this run has "
            f"{strategy.world_size}: random streams and data shards will not continue exactly"
        )
    mine = ranks[strategy.rank % len(ranks)]
    resumes = _resumes(path, saved, state.loaders, mine, len(ranks) == strategy.world_size)
    try:
        restore()
        objects.restore(saved, state)
        _commit(saved, state, precision, strategy, mine, resumes, accumulate)
    except Exception as err:
        raise ConfigError(
            f"restoring checkpoint {path} failed part-way, after every check passed "
            f"({type(err).__name__}: {_first_line(err)}): the models and optimizers may be "
            "partly restored; load it again, or start the process afresh"
        ) from err
    return {"epoch": saved["epoch"], "step": saved["step"]}


def _read_checked(
    directory: Path, precision: Precision, shards: bool
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint to load, verified, and its ``state.pt``: ConfigError when it was written
    sharded and this run is not, or the other way round."""
    path = files.latest(directory)  # verified against its manifest
    saved = _read_state(path)
    mismatch = sharded.layout_mismatch(path, saved, shards)
    if mismatch is not None:
        raise ConfigError(mismatch)
    if shards:  # what the plain load checks in _check besides the weights and optimizers
        found = precision_mismatches(saved["precision"], precision) + _progress_mismatches(saved)
        if found:
            raise ConfigError(
                f"checkpoint {path} does not fit what setup got ({'; '.join(found[:_SHOWN])}). "
                "Nothing was changed: build the run as it was when it was saved, or start "
                "without resuming"
            )
        bad = finite.problems(finite.state_entries(files.STATE, "precision", saved["precision"]))
        if bad:
            raise ConfigError(files.damaged_message(path, f"holds non-finite values ({bad[0]})"))
    return path, saved


def _check(
    path: Path,
    saved: dict[str, Any],
    weights: list[dict[str, torch.Tensor]],
    models: list[torch.nn.Module],
    state: RunState,
    precision: Precision,
) -> None:
    """ConfigError unless the checkpoint fits the live objects and holds only finite values."""
    _refuse(path, _mismatches(saved, weights, models, state, precision))
    entries: list[finite.Entry] = []
    for i, (model, tensors) in enumerate(zip(models, weights, strict=True)):
        entries += finite.model_entries(weights_name(i, len(models)), tensors, model)
    names = parameter_names(models)
    for i, (optimizer, kept) in enumerate(zip(state.optimizers, saved["optimizers"], strict=True)):
        entries += optimizer_entries(files.STATE, f"optimizer {i}", kept, optimizer, names)
    entries += finite.state_entries(files.STATE, "precision", saved["precision"])
    bad = finite.problems(entries)
    if bad:
        found = "; ".join(bad[:_SHOWN])
        raise ConfigError(files.damaged_message(path, f"holds non-finite values ({found})"))


def _refuse(path: Path, mismatches: list[str]) -> None:
    if mismatches:
        shown = "; ".join(mismatches[:_SHOWN])
        more = f"; and {len(mismatches) - _SHOWN} more" if len(mismatches) > _SHOWN else ""
        raise ConfigError(
            f"checkpoint {path} does not fit what setup got ({shown}{more}). Nothing was "
            "changed: build the models, optimizers, schedulers and tracked state as they were "
            "when it was saved, or start without resuming"
        )


# A loader's resume: the loader, its epoch, position, the random state its pass started from,
# and its private generators' states.
_Resume = tuple[Loader, int, int, dict[str, Any] | None, list[torch.Tensor] | None]


def _resumes(
    path: Path,
    saved: dict[str, Any],
    loaders: Sequence[Loader],
    rng: dict[str, Any],
    same_ranks: bool,
) -> list[_Resume]:
    """Each loader with the epoch, position, starting random state and generator states it
    resumes from (a checkpoint written before generator states were saved has none)."""
    starts = rng.get("loaders", [])
    generators = rng.get("loader_generators", [])
    resumes: list[_Resume] = []
    for i, (loader, kept) in enumerate(zip(loaders, saved["loaders"], strict=False)):
        position = _position(loader, kept, path)
        # The pass's starting random state redoes its draws only for the same batches.
        same = same_ranks and position == int(kept["position"]) and i < len(starts)
        states = generators[i] if i < len(generators) else None
        resumes.append((loader, int(kept["epoch"]), position, starts[i] if same else None, states))
    return resumes


def _commit(
    saved: dict[str, Any],
    state: RunState,
    precision: Precision,
    strategy: Strategy,
    rng: dict[str, Any],
    resumes: list[_Resume],
    accumulate: int,
) -> None:
    """Change the live progress (after the models and optimizers), in the order least likely
    to fail first."""
    precision.load_state_dict(saved["precision"])
    state.global_step, state.micro_step = saved["step"], saved["micro_step"]
    kept = saved.get("accumulate")
    if isinstance(kept, int) and kept > 0 and state.micro_step % kept == 0:
        # Saved between optimizer steps: the next micro-batch opens a window under this
        # run's accumulation, which may differ (fewer ranks, more micro-batches each).
        state.micro_step = state.global_step * accumulate
    state.stepped_at = state.micro_step
    state.oom_split = int(saved.get("oom_split", 1))
    for loader, epoch, position, start, generators in resumes:
        loader.resume(epoch, position, start, generators)
    _set_rng_state(rng, strategy.device.torch)


def _read_state(path: Path) -> dict[str, Any]:
    """``state.pt`` as data only (``weights_only=True``), with every part a load needs."""
    try:
        saved = torch.load(path / files.STATE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = re.search(r"GLOBAL ([\w.]+)", str(err))
        if refused:
            raise ConfigError(
                f"checkpoint {path / files.STATE} holds objects that are not plain tensors or "
                f"values ({refused.group(1)}), and gpukit loads checkpoints only as data, so "
                "that a checkpoint can never run code. Nothing was changed: re-save it with "
                "gpukit (rt.save), or, if you trust where it came from, load it yourself"
            ) from None
        _unreadable(path, err)
    except Exception as err:
        _unreadable(path, err)
    if not isinstance(saved, dict) or (missing := [k for k in _KEYS if k not in saved]):
        _unreadable(
            path,
            ValueError(
                f"state.pt lacks {', '.join(missing) if isinstance(saved, dict) else 'everything'}"
            ),
        )
    if saved["format"] not in (1, files.FORMAT):
        _unreadable(path, ValueError(f"unknown checkpoint format {saved['format']!r}"))
    if saved["format"] == files.FORMAT and not (path / files.MANIFEST).is_file():
        _unreadable(path, ValueError(f"{files.MANIFEST} is missing, so it cannot be verified"))
    return saved


def _read_weights(path: Path, count: int) -> list[dict[str, torch.Tensor]]:
    """Every model's weights, as CPU tensors."""
    weights = []
    for i in range(count):
        file = path / weights_name(i, count)
        if not file.is_file():
            held = sorted(p.name for p in path.glob("model*.safetensors"))
            raise ConfigError(
                f"checkpoint {path} holds {', '.join(held) or 'no weights'}, but setup got "
                f"{count} model(s), whose weights would be {file.name}: pass the same models to "
                "rt.setup as when it was saved. Nothing was changed"
            )
        try:
            weights.append(load_file(str(file), device="cpu"))
        except Exception as err:
            _unreadable(path, err)
    return weights


def _mismatches(
    saved: dict[str, Any],
    weights: list[dict[str, torch.Tensor]],
    models: list[torch.nn.Module],
    state: RunState,
    precision: Precision,
) -> list[str]:
    kept = saved["optimizers"]
    if len(kept) != len(state.optimizers):
        return [f"{len(kept)} optimizer(s) in the checkpoint, {len(state.optimizers)} now"]
    found: list[str] = []
    for i, (model, tensors) in enumerate(zip(models, weights, strict=True)):
        prefix = f"model {i}: " if len(models) > 1 else ""
        found += [prefix + m for m in model_mismatches(tensors, model)]
    names = parameter_names(models)
    for i, (optimizer, state_dict) in enumerate(zip(state.optimizers, kept, strict=True)):
        prefix = f"optimizer {i}: " if len(kept) > 1 else "optimizer: "
        found += [prefix + m for m in optimizer_mismatches(state_dict, optimizer, names)]
    found += precision_mismatches(saved["precision"], precision)
    found += _progress_mismatches(saved)
    return objects.mismatches(saved, state) + found


def _progress_mismatches(saved: dict[str, Any]) -> list[str]:
    """The counters, loaders and random states must be what a save writes."""
    found = []
    if not all(isinstance(saved[k], int) for k in ("step", "micro_step", "epoch")):
        found.append("its step counters are not whole numbers")
    loaders = saved["loaders"]
    if not isinstance(loaders, list) or not all(
        isinstance(lo, dict) and {"epoch", "position"} <= lo.keys() for lo in loaders
    ):
        found.append("its loader positions are not what gpukit writes")
    ranks = saved["rng"]
    if (
        not isinstance(ranks, list)
        or not ranks
        or not all(
            isinstance(r, dict)
            and {"python", "numpy", "torch"} <= r.keys()
            and isinstance(r["torch"], torch.Tensor)
            and _generator_states(r.get("loader_generators", []))
            for r in ranks
        )
    ):
        found.append("its random states are not what gpukit writes")
    return found


def _generator_states(saved: Any) -> bool:
    """Whether ``saved`` is what a save writes of the loaders' generators: per loader, a list
    of generator states (byte tensors)."""
    return isinstance(saved, list) and all(
        isinstance(states, list)
        and all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in states)
        for states in saved
    )


def _position(loader: Loader, saved: dict[str, Any], path: Path) -> int:
    """The saved position in this run's batches: a run resumed with another batch size goes on
    from the same sample, not from the same batch number."""
    before, now = saved.get("batch_size"), loader.batch_size
    if not before or not now or before == now or loader.sampler is None:
        return int(saved["position"])  # only a sampler of ours skips by samples
    samples = int(saved["position"]) * int(before)
    position, extra = divmod(samples, int(now))
    if extra:
        warn_user(
            f"checkpoint {path} stopped after {samples} samples of epoch {saved['epoch']} in "
            f"batches of {before}; in batches of {now} this run goes on from sample "
            f"{position * now}, so {extra} sample(s) are seen again: resume with a batch size "
            f"that divides {samples} to continue exactly"
        )
    return position


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _unreadable(path: Path, err: Exception) -> NoReturn:
    raise ConfigError(
        f"checkpoint {path} cannot be read ({type(err).__name__}: {_first_line(err)}). "
        f"Nothing was changed and it was left as it is; {files.alternative(path)}"
    ) from None


def _first_line(err: Exception) -> str:
    """The first line of an error that says what went wrong, never torch's advice to its own
    callers (such as turning ``weights_only`` off)."""
    lines = [line.strip() for line in str(err).splitlines()]
    useful = [
        line
        for line in lines
        if line
        and not line.lower().startswith("weights only load failed")
        and not any(a in line.lower() for a in _TORCH_ADVICE)
    ]
    return (useful or [""])[0][:200]
