"""Writing a checkpoint so that a crash, a kill or a bad value never costs the last good one.

Rank 0 checks every saved value is finite, writes the files into ``.tmp-step-N/`` (under
fsdp every rank first writes its shards into its ``sharded/`` folder, checking its own, see
``sharded``), fsyncs them, writes ``manifest.json`` last, renames the folder into place and
only then points ``latest`` at it and prunes. A checkpoint holding NaN or Inf is written for
inspection but marked bad in its manifest: ``latest`` keeps naming the last good one and
nothing is pruned. A write the disk refuses (full, read-only, not permitted, a file too large)
leaves nothing behind and ``latest`` as it was, and every rank raises one
``CheckpointWriteError`` that says why (see ``failure``).

Given a :class:`~gpukit.checkpoint.background.Background` (``async_save``), a save of whole
weights does its collective part as above (the ranks' random states, the checks, the
agreement) and copies what it writes to host memory; the files are then written, fsynced,
renamed and published by a thread while training goes on, in the same format (see
``background``). A sharded save copies every rank's shards to host memory and writes them
from a thread on every rank (see ``sharded_behind``).
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import save_file, save_model

from gpukit.checkpoint import files, finite, objects, publish, sharded, sharded_behind, snapshot
from gpukit.checkpoint.background import Background
from gpukit.checkpoint.export import export as export_weights
from gpukit.checkpoint.failure import (
    Failures,
    check_room,
    clean_up,
    needed_bytes,
    raise_agreed,
)
from gpukit.checkpoint.fit import (
    optimizer_entries,
    parameter_names,
    user_models,
    weights_name,
)
from gpukit.checkpoint.live import Loader, Precision, RunState
from gpukit.errors import ConfigError, warn_user
from gpukit.strategies import Strategy


def save(
    directory: Path,
    state: RunState,
    strategy: Strategy,
    precision: Precision,
    *,
    accumulate: int = 1,
    keep: int = 3,
    export: bool = True,
    background: Background | None = None,
) -> Path:
    """Write a checkpoint of ``state``'s models, optimizers and progress; returns its folder.

    Collective: every rank calls it (rank 0 writes; under fsdp every rank writes its shards
    too). Under fsdp ``export`` says whether it also holds the full weights (the shards
    alone resume the run). See :mod:`gpukit.checkpoint`.
    With ``background``, the files are written by a thread after this returns (the
    collective part and the host copies done here): rank 0's, or under fsdp every rank's.
    Users call it through the Runtime::

        rt.save("ckpt", keep=3)  # ckpt/step-00000040/ and ckpt/latest
    """
    if keep < 1:
        raise ConfigError(f"keep={keep}: keep at least the newest checkpoint (keep=1)")
    if state.micro_step % accumulate:
        warn_user(
            f"saving in the middle of an accumulation window (micro-step {state.micro_step}, "
            f"accumulate={accumulate}): the partial gradients are not saved, so a resumed "
            "run will not continue exactly; save right after an optimizer step"
        )
    # Every rank checks what it would write (schedulers, tracked state): a refusal on rank 0
    # alone would leave the others waiting.
    extras = objects.entries(state)
    # Every rank takes part: its RNG states, and where its loaders' passes started.
    rng = strategy.all_gather_object(_rng_state(strategy.device.torch, state.loaders))
    final = directory / files.folder_name(state.global_step)
    tmp = directory / f".tmp-{final.name}"
    models = user_models(state, strategy, precision)
    shards = sharded.applies(models)
    # A write the disk refuses is noted, this rank's own writing stops, and it still takes
    # part in every collective below: the ranks then agree and all raise one error.
    failures = Failures()
    if strategy.rank == 0:
        with failures.noted():
            # The writer holds the folder while it writes (a Runtime holds its own all along),
            # so no .tmp-* of a live writer is ever taken for a leftover below.
            failures.hold(directory)
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    if background is not None and shards:
        progress = None
        if strategy.rank == 0:
            progress = _progress(state, strategy, precision, rng, True, accumulate)
            progress["fresh_optimizers"] = [
                i for i, o in enumerate(state.optimizers) if not o.state
            ]
            progress |= extras
        return sharded_behind.save(
            background,
            directory,
            final,
            failures,
            state,
            strategy,
            models,
            progress,
            keep=keep,
            export=export,
        )
    if background is not None:
        return _save_behind(
            background,
            directory,
            final,
            failures,
            state,
            strategy,
            precision,
            rng,
            extras,
            accumulate=accumulate,
            keep=keep,
        )
    bad: list[str] = []
    exported: list[str] = []  # rank 0: the weights files the export wrote
    # Optimizers that have not stepped yet: laying out their state for the shards gives them
    # one (a step at learning rate 0, AdamW's step count 1), which must not outlive the save.
    fresh = [i for i, o in enumerate(state.optimizers) if not o.state] if shards else []
    if shards and not failures.agree(strategy):  # every rank writes its own shards
        try:
            with failures.noted():
                bad = sharded.save(tmp, models, state.optimizers, strategy)
        finally:
            for i in fresh:
                state.optimizers[i].state.clear()
        if export and not failures.agree(strategy):  # then each full weight, one at a time
            guard = failures.noted if strategy.rank == 0 else None
            for i, model in enumerate(models):
                name = weights_name(i, len(models))
                wrote, problems = export_weights(model, strategy, tmp, name, guard=guard)
                exported += wrote
                bad += problems
    if strategy.rank == 0 and failures.ok and failures.agreed:
        with failures.noted():
            progress = _progress(state, strategy, precision, rng, shards, accumulate)
            progress["fresh_optimizers"] = fresh  # a resume leaves them stateless too
            progress |= extras
            if shards:  # the weights were checked as they were exported
                bad += finite.problems(
                    finite.state_entries(files.STATE, "precision", progress["precision"])
                )
            else:
                bad = finite.problems(_entries(models, state, progress))
                for i, model in enumerate(models):
                    save_model(model, str(tmp / weights_name(i, len(models))))
                    exported.append(weights_name(i, len(models)))
            for name in exported:
                files.ordinary_mode(tmp / name)
            torch.save(progress, tmp / files.STATE)
    known: dict[str, Any] = {}
    if shards and failures.agreed:
        # Each rank flushes and hashes the shard files it wrote, all at once, instead of rank
        # 0 reading everyone's while they wait: the whole model's bytes, at scale.
        mine: dict[str, Any] = {}
        with failures.noted():
            mine = files.describe(tmp, sharded.written_by(tmp, strategy.rank))
        for part in strategy.all_gather_object(mine):
            known.update(part)
    if strategy.rank == 0 and failures.ok and failures.agreed:
        with failures.noted():
            publish.finish(directory, final, state.global_step, bad, known, keep)
    found = failures.agree(strategy)  # also the barrier: every rank leaves with the outcome
    if found:
        needed = 0
        if strategy.rank == 0 and not failures.busy:
            clean_up(directory, tmp)
            needed = needed_bytes(models, state.optimizers)
        failures.release()
        raise_agreed(found, failures.error, strategy, directory, state.global_step, needed)
    failures.release()
    return final


def _save_behind(
    background: Background,
    directory: Path,
    final: Path,
    failures: Failures,
    state: RunState,
    strategy: Strategy,
    precision: Precision,
    rng: list[dict[str, Any]],
    extras: dict[str, Any],
    *,
    accumulate: int,
    keep: int,
) -> Path:
    """The foreground of a save written by ``background``'s thread: rank 0 checks the values,
    finds room for them and copies them to host memory; the ranks agree on that part's
    failures (collective), then rank 0's thread writes and publishes."""
    tmp = directory / f".tmp-{final.name}"
    models = user_models(state, strategy, precision)
    write = None
    needed = 0
    lease = None
    if strategy.rank == 0 and failures.ok:
        with failures.noted():
            needed = needed_bytes(models, state.optimizers)
            check_room(directory, needed)
            progress = _progress(state, strategy, precision, rng, False, accumulate)
            progress["fresh_optimizers"] = []
            progress |= extras
            # Into the last save's copies: the write that read them has ended (this save
            # settled it first), and a lease never hands out memory a write still reads.
            lease = background.buffers.lease()
            weights = [snapshot.weights(model, lease.copy) for model in models]
            progress = snapshot.tree(progress, lease.copy)
            # The check reads the copies, on the thread: the values saved, off the step's path.
            named = [
                snapshot.named(m.state_dict(), *w) for m, w in zip(models, weights, strict=True)
            ]
            entries = _entries(models, state, progress, named)
            snapshot.wait_copies(strategy.device.torch)
            step = state.global_step

            def write() -> None:
                assert lease is not None
                try:
                    bad = finite.problems(entries)
                    for i, (tensors, metadata) in enumerate(weights):
                        name = weights_name(i, len(weights))
                        save_file(tensors, str(tmp / name), metadata=metadata)
                        files.ordinary_mode(tmp / name)
                    torch.save(progress, tmp / files.STATE)
                finally:
                    lease.give_back()  # the copies are read: the next save may fill them
                publish.finish(directory, final, step, bad, {}, keep)

    found = failures.agree(strategy)  # what went wrong here, before the thread starts
    if found:
        if lease is not None:  # no thread will read the copies
            lease.give_back()
        if strategy.rank == 0 and not failures.busy:
            clean_up(directory, tmp)
        failures.release()
        raise_agreed(found, failures.error, strategy, directory, state.global_step, needed)
    if write is None:  # ranks other than 0: nothing to write
        failures.release()
        return final
    background.start(
        write,
        step=state.global_step,
        directory=directory,
        tmp=tmp,
        failures=failures,
        needed=needed,
    )
    return final


def _entries(
    models: list[Any],
    state: RunState,
    progress: dict[str, Any],
    weights: Sequence[dict[str, Any]] | None = None,
) -> list[finite.Entry]:
    """What the finiteness check reads: the models' weights (``weights``, their host copies,
    when given), the optimizers' and the precision's state in ``progress``."""
    entries: list[finite.Entry] = []
    for i, model in enumerate(models):
        tensors = model.state_dict() if weights is None else weights[i]
        entries += finite.model_entries(weights_name(i, len(models)), tensors, model)
    names = parameter_names(models)
    for i, (optimizer, kept) in enumerate(
        zip(state.optimizers, progress["optimizers"], strict=True)
    ):
        entries += optimizer_entries(files.STATE, f"optimizer {i}", kept, optimizer, names)
    entries += finite.state_entries(files.STATE, "precision", progress["precision"])
    return entries


def _progress(
    state: RunState,
    strategy: Strategy,
    precision: Precision,
    rng: list[dict[str, Any]],
    shards: bool,
    accumulate: int,
) -> dict[str, Any]:
    loaders = [lo.state_dict() for lo in state.loaders]
    return {
        "format": files.FORMAT,
        "epoch": loaders[0]["epoch"] if loaders else 0,
        "step": state.global_step,
        "micro_step": state.micro_step,
        "accumulate": accumulate,
        "oom_split": state.oom_split,  # the split recovery found: not to be found again
        "world_size": strategy.world_size,
        "loaders": loaders,
        "layout": sharded.LAYOUT if shards else "full",
        # Sharded: the optimizers' state is in the shards; here only how many there are.
        "optimizers": [sharded.LAYOUT] * len(state.optimizers)
        if shards
        else [o.state_dict() for o in state.optimizers],
        "precision": precision.state_dict(),
        "rng": rng,
    }


def _rng_state(device: torch.device, loaders: Sequence[Loader]) -> dict[str, Any]:
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
    # Saved at every save, between passes too: where the pass's start is not saved, nothing
    # else says which order the next pass of a loader with a generator of its own takes.
    state["loader_generators"] = [lo.generator_states() for lo in loaders]
    return state
