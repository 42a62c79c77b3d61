"""Checkpoints that resume a run exactly, written so a crash never leaves a half-written one.

A checkpoint is a folder ``step-00000123/`` under the directory given, holding:

- ``model.safetensors`` (or ``model-N.safetensors`` for several models): the weights;
- ``state.pt``: optimizer and gradient-scaler state, epoch, step, each loader's position
  inside its epoch (in batches, with their size, so another batch size resumes at the same
  sample), and the RNG states of every rank, with the state each loader's pass started from
  (the resumed pass redoes that start's draws: its order and its workers' seeds).

Rank 0 writes into a temporary folder, fsyncs every file, renames the folder into place and
then points the file ``latest`` at it (written the same way); the oldest checkpoints beyond
``keep`` are removed. Loading reads ``state.pt`` with ``weights_only=True``, so a checkpoint
can hold tensors and plain values but never run code.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, NoReturn, cast

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from gpukit.errors import ConfigError, warn_user
from gpukit.runtime.data import DeviceLoader
from gpukit.runtime.precision import Precision
from gpukit.runtime.state import TrainState, user_model
from gpukit.strategies import Strategy

FORMAT = 1
LATEST = "latest"


def save(
    directory: Path,
    state: TrainState,
    strategy: Strategy,
    precision: Precision,
    *,
    accumulate: int = 1,
    keep: int = 3,
) -> Path:
    """Write a checkpoint of ``state``'s models, optimizers and progress; returns its folder."""
    if keep < 1:
        raise ConfigError(f"keep={keep}: keep at least the newest checkpoint (keep=1)")
    if state.micro_step % accumulate:
        warn_user(
            f"saving in the middle of an accumulation window (micro-step {state.micro_step}, "
            f"accumulate={accumulate}): the partial gradients are not saved, so a resumed "
            "run will not continue exactly; save right after an optimizer step"
        )
    # Every rank takes part: its RNG states, and where its loaders' passes started.
    rng = strategy.all_gather_object(_rng_state(strategy.device.torch, state.loaders))
    final = directory / f"step-{state.global_step:08d}"
    models = _user_models(state, strategy, precision)
    if strategy.rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for i, model in enumerate(models):
            save_model(model, str(tmp / _weights_name(i, len(models))))
        torch.save(_progress(state, strategy, precision, rng), tmp / "state.pt")
        for f in tmp.iterdir():
            _fsync(f)
        old = directory / f".old-{final.name}"
        if final.exists():  # the same step saved again: swap, so `latest` never dangles long
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _write_atomically(directory / LATEST, final.name)
        shutil.rmtree(old, ignore_errors=True)
        _fsync(directory)
        _prune(directory, keep)
    strategy.barrier()
    return final


def load(
    directory: Path, state: TrainState, strategy: Strategy, precision: Precision
) -> dict[str, int]:
    """Restore the newest checkpoint under ``directory`` into ``state`` (after ``setup``)."""
    path = latest(directory)
    try:
        saved = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        if saved.get("format") != FORMAT:
            raise ValueError(f"unknown checkpoint format {saved.get('format')!r}")
    except Exception as err:
        _unreadable(path, err)
    if len(saved["optimizers"]) != len(state.optimizers):
        raise ConfigError(
            f"checkpoint {path} holds {len(saved['optimizers'])} optimizer(s), but setup got "
            f"{len(state.optimizers)}: pass the same optimizers to rt.setup as when it was saved"
        )
    models = _user_models(state, strategy, precision)
    try:
        for i, model in enumerate(models):
            load_model(
                model, str(path / _weights_name(i, len(models))), device=str(strategy.device)
            )
    except Exception as err:
        _unreadable(path, err)
    for optimizer, kept in zip(state.optimizers, saved["optimizers"], strict=True):
        optimizer.load_state_dict(kept)
    precision.load_state_dict(saved["precision"])
    state.global_step, state.micro_step = saved["step"], saved["micro_step"]
    state.stepped_at = state.micro_step
    state.oom_split = int(saved.get("oom_split", 1))
    ranks = saved["rng"]
    if len(ranks) != strategy.world_size:
        warn_user(
            f"checkpoint {path} was written by {len(ranks)} rank(s), this run has "
            f"{strategy.world_size}: random streams and data shards will not continue exactly"
        )
    mine = ranks[strategy.rank % len(ranks)]
    starts = mine.get("loaders", [])
    for i, (loader, kept) in enumerate(zip(state.loaders, saved["loaders"], strict=False)):
        position = _position(loader, kept, path)
        # The pass's starting random state redoes its draws only for the same batches.
        same = position == int(kept["position"]) and len(ranks) == strategy.world_size
        start = starts[i] if same and i < len(starts) else None
        loader.resume(int(kept["epoch"]), position, start)
    _set_rng_state(mine, strategy.device.torch)
    return {"epoch": saved["epoch"], "step": saved["step"]}


def _user_models(state: TrainState, strategy: Strategy, precision: Precision) -> list[Any]:
    """The user's own models inside what setup returned: their keys are the checkpoint's."""
    return [user_model(m, strategy, precision) for m in state.modules]


def _position(loader: DeviceLoader, saved: dict[str, Any], path: Path) -> int:
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


def _unreadable(path: Path, err: Exception) -> NoReturn:
    reason = (str(err).strip().splitlines() or [""])[0][:200]
    raise ConfigError(
        f"checkpoint {path} cannot be read ({type(err).__name__}: {reason}); it was left "
        "as it is: resume from another folder, or start without resuming"
    ) from None


def latest(directory: Path) -> Path:
    """The folder the ``latest`` file names; ConfigError when there is none."""
    pointer = directory / LATEST
    if not pointer.is_file():
        raise ConfigError(
            f"no checkpoint in {directory} (no '{LATEST}' file there): check the path, or run "
            "once without resuming to create one"
        )
    path = directory / pointer.read_text().strip()
    if not (path / "state.pt").is_file():
        raise ConfigError(
            f"checkpoint {path} named by {pointer} is missing or incomplete: resume from "
            "another folder, or start without resuming"
        )
    return path


def _progress(
    state: TrainState, strategy: Strategy, precision: Precision, rng: list[dict[str, Any]]
) -> dict[str, Any]:
    loaders = [lo.state_dict() for lo in state.loaders]
    return {
        "format": FORMAT,
        "epoch": loaders[0]["epoch"] if loaders else 0,
        "step": state.global_step,
        "micro_step": state.micro_step,
        "oom_split": state.oom_split,  # the split recovery found: not to be found again
        "world_size": strategy.world_size,
        "loaders": loaders,
        "optimizers": [o.state_dict() for o in state.optimizers],
        "precision": precision.state_dict(),
        "rng": rng,
    }


def _rng_state(device: torch.device, loaders: list[DeviceLoader]) -> dict[str, Any]:
    # Plain lists and tensors only: they load under weights_only=True.
    numpy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    kind, keys, pos, has_gauss, cached = numpy_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":  # this rank's own GPU only: touching others would make contexts
        state["cuda"] = torch.cuda.get_rng_state(device)
    state["loaders"] = [lo.pass_rng() for lo in loaders]
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _weights_name(index: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{index}.safetensors"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(text + "\n")
    _fsync(tmp)
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(directory: Path, keep: int) -> None:
    steps = sorted(p for p in directory.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
