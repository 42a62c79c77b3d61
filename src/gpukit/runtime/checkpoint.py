"""Checkpoints that resume a run exactly, written so a crash never leaves a half-written one.

A checkpoint is a folder ``step-00000123/`` under the directory given, holding:

- ``model.safetensors`` (or ``model-N.safetensors`` for several models): the weights;
- ``state.pt``: optimizer and gradient-scaler state, epoch, step, each loader's position
  inside its epoch (in batches, with their size, so another batch size resumes at the same
  sample), and the RNG states of every rank.

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
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from gpukit.errors import ConfigError, warn_user

if TYPE_CHECKING:
    from gpukit.runtime.data import DeviceLoader
    from gpukit.runtime.runtime import Runtime

FORMAT = 1
LATEST = "latest"


def save(rt: Runtime, directory: Path, keep: int = 3) -> Path:
    """Write a checkpoint of ``rt``'s models, optimizers and progress; returns its folder."""
    if keep < 1:
        raise ConfigError(f"keep={keep}: keep at least the newest checkpoint (keep=1)")
    if rt.micro_step % rt.accumulate:
        warn_user(
            f"saving in the middle of an accumulation window (micro-step {rt.micro_step}, "
            f"accumulate={rt.accumulate}): the partial gradients are not saved, so a resumed "
            "run will not continue exactly; save right after an optimizer step"
        )
    rng = rt.strategy.all_gather_object(_rng_state(rt.device.torch))  # every rank takes part
    final = directory / f"step-{rt.global_step:08d}"
    if rt.is_global_zero:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for i, module in enumerate(rt._modules):
            save_model(rt.unwrap(module), str(tmp / _weights_name(i, len(rt._modules))))
        torch.save(_progress(rt, rng), tmp / "state.pt")
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
    rt.barrier()
    return final


def load(rt: Runtime, directory: Path) -> dict[str, int]:
    """Restore the newest checkpoint under ``directory`` into ``rt`` (after ``rt.setup``)."""
    path = latest(directory)
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        if state.get("format") != FORMAT:
            raise ValueError(f"unknown checkpoint format {state.get('format')!r}")
    except Exception as err:
        _unreadable(path, err)
    if len(state["optimizers"]) != len(rt._optimizers):
        raise ConfigError(
            f"checkpoint {path} holds {len(state['optimizers'])} optimizer(s), but setup got "
            f"{len(rt._optimizers)}: pass the same optimizers to rt.setup as when it was saved"
        )
    try:
        for i, module in enumerate(rt._modules):
            load_model(
                rt.unwrap(module),
                str(path / _weights_name(i, len(rt._modules))),
                device=str(rt.device),
            )
    except Exception as err:
        _unreadable(path, err)
    for optimizer, saved in zip(rt._optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    rt.precision.load_state_dict(state["precision"])
    for loader, saved in zip(rt.loaders, state["loaders"], strict=False):
        loader.epoch, loader.position = saved["epoch"], _position(loader, saved, path)
    rt.global_step, rt.micro_step = state["step"], state["micro_step"]
    rt.oom_split = int(state.get("oom_split", 1))
    ranks = state["rng"]
    if len(ranks) != rt.world_size:
        warn_user(
            f"checkpoint {path} was written by {len(ranks)} rank(s), this run has "
            f"{rt.world_size}: random streams and data shards will not continue exactly"
        )
    _set_rng_state(ranks[rt.rank % len(ranks)], rt.device.torch)
    return {"epoch": state["epoch"], "step": state["step"]}


def _position(loader: DeviceLoader, saved: dict[str, Any], path: Path) -> int:
    """The saved position in this run's batches: a run resumed with another batch size goes on
    from the same sample, not from the same batch number."""
    before, now = saved.get("batch_size"), loader.loader.batch_size
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


def _progress(rt: Runtime, rng: list[dict[str, Any]]) -> dict[str, Any]:
    loaders = [
        {"epoch": lo.epoch, "position": lo.position, "batch_size": lo.loader.batch_size}
        for lo in rt.loaders
    ]
    return {
        "format": FORMAT,
        "epoch": loaders[0]["epoch"] if loaders else 0,
        "step": rt.global_step,
        "micro_step": rt.micro_step,
        "oom_split": rt.oom_split,  # the micro-batch split recovery found: not to be found again
        "world_size": rt.world_size,
        "loaders": loaders,
        "optimizers": [o.state_dict() for o in rt._optimizers],
        "precision": rt.precision.state_dict(),
        "rng": rng,
    }


def _rng_state(device: torch.device) -> dict[str, Any]:
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
