"""The behaviours that differ once a program is moved to gpukit, each said in one line, and
the library whose programs show it (``gpukit check`` says those its scan finds; the guide,
docs/migrating.md, lists them all, tested against this table)."""

from __future__ import annotations

from dataclasses import dataclass

from gpukit.migration.table import Library


@dataclass(frozen=True)
class Behaviour:
    """Something a moved program will do differently, said once where a program shows it."""

    key: str
    library: Library
    text: str


BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(
        "shuffle",
        "accelerate",
        "A shuffled loader over several ranks: gpukit deals a `DistributedSampler`'s order by "
        'default; `gk.Runtime(data_order="accelerate")` keeps Accelerate\'s batches on every rank.',
    ),
    Behaviour(
        "scheduler-per-batch",
        "accelerate",
        "A scheduler stepped every batch: on N ranks gpukit steps it N times per optimizer step, "
        "as Accelerate's prepared scheduler does, so the learning rate at each sample count is "
        "the same; build it for one process's step count (`len(loader)` before `rt.setup`).",
    ),
    Behaviour(
        "scheduler-per-epoch",
        "accelerate",
        "A scheduler stepped once an epoch: Accelerate steps it N times per call on N "
        "processes, gpukit once per epoch, as one process does; on N ranks its learning rate "
        "now falls N times slower than under Accelerate.",
    ),
    Behaviour(
        "log",
        "accelerate",
        "`rt.log_metrics(step=N, ...)` records the values as given, on each rank, and rank 0 "
        "sends them to the loggers (as Accelerate's main process does): combine values that "
        "differ by rank first (`rt.all_reduce`).",
    ),
    Behaviour(
        "gather",
        "accelerate",
        "`accelerator.gather(x)` concatenates the ranks' tensors on the first dimension; "
        "`rt.all_gather(x)` stacks them on a new one (`.flatten(0, 1)` joins them; a 0-d "
        "tensor gives one value per rank either way).",
    ),
    Behaviour(
        "checkpoint",
        "accelerate",
        "`rt.save(folder)` writes gpukit's checkpoint (model, optimizers, schedulers, the "
        "loaders' positions, random states), not Accelerate's files: a folder `save_state` "
        'wrote gives its weights to `rt.load_weights("folder/model.safetensors")`.',
    ),
    Behaviour(
        "shuffle",
        "fabric",
        "A shuffled loader over several ranks: Fabric seeds its `DistributedSampler` from "
        "`seed_everything`, gpukit from `gk.Runtime(seed=...)`: give that the same seed to keep "
        "Fabric's batches.",
    ),
    Behaviour(
        "accumulate",
        "fabric",
        "Accumulation: `rt.backward` divides the loss by `accumulate`, Fabric's backward does "
        "not: drop the program's own division, or the gradients shrink N times.",
    ),
    Behaviour(
        "scheduler-per-batch",
        "fabric",
        "A scheduler stepped every batch and given to `rt.setup`: on N ranks gpukit steps it N "
        "times per optimizer step, so the learning rate follows the samples seen as in one "
        "process (build it for one process's step count; Fabric's fell N times slower); "
        '`gk.Runtime(scheduler_steps="per-optimizer-step")` keeps one step per call.',
    ),
    Behaviour(
        "launch",
        "fabric",
        "`fabric.launch()` with no function runs the rest of the script in each process: put "
        "the training in a function for `rt.launch(fn)`, or start the script with "
        "`gpukit launch --nproc N`.",
    ),
    Behaviour(
        "save",
        "fabric",
        "`rt.save(path, state)` writes one file from rank 0 with whole state dicts; "
        "`rt.save(folder)` is gpukit's resumable checkpoint (loaders' positions and random "
        "states too).",
    ),
    Behaviour(
        "sampler",
        "ddp",
        "Your `DistributedSampler` is kept as it is, and gpukit calls its `set_epoch` before "
        "each pass unless the program does.",
    ),
    Behaviour(
        "all_reduce",
        "ddp",
        "`rt.all_reduce(t)` returns the result and leaves `t` as it was, and its default op is "
        '`"mean"`: `dist.all_reduce(t)` summed in place.',
    ),
    Behaviour(
        "scheduler-per-batch",
        "ddp",
        "A scheduler stepped every batch and given to `rt.setup`: on N ranks gpukit steps it N "
        "times per optimizer step, so the learning rate follows the samples seen as in one "
        "process (build it for one process's step count; DDP's fell N times slower); "
        '`gk.Runtime(scheduler_steps="per-optimizer-step")` keeps one step per call.',
    ),
    Behaviour(
        "rank0-save",
        "ddp",
        "`torch.save` under a rank-0 test: `rt.save` is collective, call it on every rank "
        "(rank 0 alone writes); under `if rank == 0:` it fails after 30 s, naming the ranks.",
    ),
    Behaviour(
        "accumulate",
        "ddp",
        "Accumulation: `rt.backward` divides the loss by `accumulate`: drop the program's own "
        "division, or the gradients shrink N times.",
    ),
    Behaviour(
        "spawn",
        "ddp",
        "`rt.launch(fn, ...)` calls `fn(rt, ...)` in each rank and returns rank 0's result; "
        "each rank imports `fn` from the script, so it stays at module level.",
    ),
)
