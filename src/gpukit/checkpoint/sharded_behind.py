"""A sharded (fsdp) checkpoint written in the background (``async_save``): every rank copies
its shards to host memory in the save, and a thread on every rank writes them through
``torch.distributed.checkpoint`` (DCP) while training goes on.

In the save (the foreground, every rank): the ranks' random states and the checks as in a
synchronous save; each rank's shards of the weights and optimizer states copied to host memory
(a DTensor stays one, its local shard copied, see ``snapshot``); with ``export`` the full
weights gathered one at a time onto rank 0's host memory, since their all-gathers run on the
training group, and that group must never see collectives from two threads at once; rank 0's
``state.pt`` copied. Then the ranks agree on what failed so far, as a synchronous save does.

On the thread (every rank): ``dcp.save`` of the copies into ``.tmp-step-N/sharded/``, its
planning collectives on the strategy's background group (gloo, made once per run beside the
training one, see ``Strategy.background_group``); each rank checks its optimizer shards and
describes (fsyncs and hashes) the files it wrote; the ranks gather what they found on that same
group. Only when every rank wrote and described its shards does rank 0 write the exported
weights and ``state.pt``, then the manifest, rename the folder, point ``latest`` and prune
(``publish.finish``): a kill or crash of any rank before then leaves ``latest`` on the previous
checkpoint. A failed write is noted by the rank that met it and raised on every rank, as one
``CheckpointWriteError``, where they next settle (``background``).

Torch's own ``dcp.async_save`` does the staging and the thread too, but its thread pool is not
a daemon (the end of a process waits for it, past a stop's grace) and its options moved between
versions (``async_checkpointer_type`` and ``async_stager`` are not in torch 2.4's); ``dcp.save``
with ``process_group=`` on a thread of gpukit's own works alike from torch 2.4 on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpukit.checkpoint import export as exports
from gpukit.checkpoint import files, finite, publish, sharded, snapshot
from gpukit.checkpoint.background import Background
from gpukit.checkpoint.failure import Failures, check_room, clean_up, needed_bytes, raise_agreed
from gpukit.checkpoint.fit import weights_name
from gpukit.checkpoint.live import RunState
from gpukit.strategies import Strategy


def save(
    background: Background,
    directory: Path,
    final: Path,
    failures: Failures,
    state: RunState,
    strategy: Strategy,
    models: list[torch.nn.Module],
    progress: dict[str, Any] | None,
    *,
    keep: int,
    export: bool,
) -> Path:
    """The foreground of a sharded save written by ``background``'s thread on every rank
    (collective). ``progress``: rank 0's ``state.pt`` (None elsewhere); ``export``: whether
    the checkpoint holds the full weights too."""
    tmp = directory / f".tmp-{final.name}"
    group = strategy.background_group()  # made at the first such save, where every rank is
    # DTensors count whole: about every rank's shards together, all on the folder's disk,
    # which rank 0 checks (it made the folder; the others may not see it yet).
    needed = needed_bytes(models, state.optimizers)
    if export:  # the full weights once more, beside their shards
        needed += needed_bytes(models, [])
    if strategy.rank == 0 and failures.ok:
        with failures.noted():
            check_room(directory, needed)
    staged: dict[str, Any] = {}
    gathered: list[exports.Gathered | None] = []
    if not failures.agree(strategy):  # rank 0's folder and room
        # Optimizers that have not stepped yet: laying out their state gives them one, which
        # must not outlive the save (as in a synchronous one).
        fresh = [o for o in state.optimizers if not o.state]
        try:
            staged = sharded.stage(models, state.optimizers)
        finally:
            for optimizer in fresh:
                optimizer.state.clear()
        if export:  # all-gathers on the training group: here, never on the thread
            gathered = [
                exports.gather(model, strategy, weights_name(i, len(models)))
                for i, model in enumerate(models)
            ]
        if progress is not None:
            progress = snapshot.tree(progress)
        snapshot.wait_copies(strategy.device.torch)
    found = failures.agree(strategy)  # what went wrong here, before the threads start
    if found:
        if strategy.rank == 0 and not failures.busy:
            clean_up(directory, tmp)
        failures.release()
        raise_agreed(found, failures.error, strategy, directory, state.global_step, needed)
    step, rank, device = state.global_step, strategy.rank, strategy.device.torch

    def write() -> bool:
        bad: list[str] = []
        mine: dict[str, Any] = {}
        error: BaseException | None = None
        try:
            use_device(device)
            bad = sharded.write(staged, tmp, rank, group)
            # Each rank fsyncs and hashes its own files, all at once (see writer).
            mine = files.describe(tmp, sharded.written_by(tmp, rank))
        except BaseException as err:  # raised below, once every rank has joined the gather
            error = err
        said = _all_gather_object((mine, bad, error is None), group)
        if error is not None:
            raise error
        if not all(ok for _, _, ok in said):  # another rank failed and raises it at settle
            if rank == 0:
                clean_up(directory, tmp)
            return False  # not landed: this rank's part alone went well
        if rank != 0:
            return True
        known = {name: entry for part, _, _ in said for name, entry in part.items()}
        found = sorted({line for _, lines, _ in said for line in lines})
        _finish(directory, final, step, keep, tmp, found, known, gathered, progress)
        return True

    background.start(
        write,
        step=step,
        directory=directory,
        tmp=tmp if rank == 0 else None,
        failures=failures,
        needed=needed,
    )
    return final


def use_device(device: torch.device) -> None:
    """Make this rank's GPU the current one on the writing thread: a new thread starts on
    GPU 0, and DCP's writer, given host copies, still synchronises the current device's
    stream, which would make every rank a context on GPU 0 (memory there, every rank's)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _finish(
    directory: Path,
    final: Path,
    step: int,
    keep: int,
    tmp: Path,
    bad: list[str],
    known: dict[str, Any],
    gathered: list[exports.Gathered | None],
    progress: dict[str, Any] | None,
) -> None:
    """Rank 0's thread, every rank's shards written and described: the exported weights,
    ``state.pt``, then the manifest and the rename (``publish.finish``), in the synchronous
    save's order, so the manifest lists the same problems in the same order."""
    assert progress is not None, "rank 0 holds the progress"
    exported: list[str] = []
    for weights in gathered:
        if weights is not None:
            wrote, problems = exports.write(weights, tmp)
            exported += wrote
            bad += problems
    bad += finite.problems(finite.state_entries(files.STATE, "precision", progress["precision"]))
    for name in exported:
        files.ordinary_mode(tmp / name)
    torch.save(progress, tmp / files.STATE)
    publish.finish(directory, final, step, bad, known, keep)


def _all_gather_object(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` over ``group`` (the background's), in rank order; ``[obj]`` in a
    process without a process group."""
    if not dist.is_initialized():
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered
