"""gpukit's spelling of each call a program written for Accelerate, Lightning Fabric, plain
DDP (torchrun) or ``torch.multiprocessing.spawn`` makes: the one table behind both
``gpukit check`` and the guide (docs/migrating.md, whose tables are tested against it).

``gpukit`` and ``note`` are written as the guide shows them (code in backticks); the command
line prints them without the backticks.

>>> from gpukit.migration.table import rows_of
>>> next(r.gpukit for r in rows_of("accelerate") if r.call == "accelerator.backward(loss)")
'`rt.backward(loss)`'
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, cast

Library = Literal["accelerate", "fabric", "ddp", "torch"]
# What the scan matches: a method of the Accelerator or Fabric object, one of its attributes
# read, a keyword of its constructor, a function by its full import name, a method called on
# any object (``set_epoch``), on an optimizer or a scheduler, or an environment variable read;
# a method's keyword that changes what the method does (``method.keyword``) is a row of its own.
Kind = Literal[
    "method", "method-keyword", "attribute", "keyword", "function", "any-method", "optimizer", "env"
]


@dataclass(frozen=True)
class Translation:
    """One call as the program writes it (``call``), gpukit's spelling, and how the two
    behave differently, where they do."""

    library: Library
    kind: Kind
    name: str  # the method, attribute or keyword; a function's full name; a variable's name
    call: str
    gpukit: str
    note: str = ""


def _parse(library: Library, rows: str) -> list[Translation]:
    """One row a line, ``KIND NAME | call | gpukit | note``; an indented line goes on."""
    joined: list[str] = []
    for line in rows.strip().splitlines():
        if line.startswith(" ") and joined:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    table = []
    for row in joined:
        key, call, gpukit, *note = (cell.strip() for cell in row.split(" | "))
        kind, name = key.split(" ")
        table.append(Translation(library, cast(Kind, kind), name, call, gpukit, "".join(note)))
    return table


ACCELERATE = _parse(
    "accelerate",
    """
function accelerate.Accelerator | accelerator = Accelerator(...) | `rt = gk.Runtime(...)`
function accelerate.utils.set_seed | set_seed(seed) | `gk.Runtime(seed=seed)`
keyword cpu | Accelerator(cpu=True) | `gk.Runtime(devices="cpu")` | every rank on the CPU under
    a launcher
keyword mixed_precision | Accelerator(mixed_precision="bf16") |
    `gk.Runtime(precision="bf16-mixed")` | `"fp16"` is `"16-mixed"`, `"no"` is `"32"`
keyword gradient_accumulation_steps | Accelerator(gradient_accumulation_steps=N) |
    `gk.Runtime(accumulate=N)`
keyword log_with | Accelerator(log_with="tensorboard") | `gk.Runtime(loggers=["tensorboard"])` |
    see [Loggers](loggers.md)
keyword project_dir | Accelerator(project_dir=folder) | `gk.Runtime(checkpoints=folder)` | where
    `rt.save()` without a folder writes
keyword step_scheduler_with_optimizer | Accelerator(step_scheduler_with_optimizer=False) |
    `gk.Runtime(scheduler_steps="per-optimizer-step")` | one step per call on every rank count
keyword split_batches | Accelerator(split_batches=True) |
    `gk.Runtime(data_order="accelerate", split_batches=True)` | every batch cut into one piece
    per rank: the loader's batch size is the total over the ranks
keyword even_batches | Accelerator(even_batches=False) |
    `gk.Runtime(data_order="accelerate", even_batches=False)` | the last round left short;
    True (the default) completes it from the pass's first samples
keyword dataloader_config | Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=...,
    even_batches=...)) | `gk.Runtime(data_order="accelerate",
    split_batches=..., even_batches=...)` | its other fields (`dispatch_batches`,
    `use_seedable_sampler`...) have no gpukit spelling
method prepare | accelerator.prepare(model, optimizer, loader, scheduler) | `rt.setup(model,
    optimizer, loader, scheduler)` | the model first; loaders alone: `rt.setup(loader1,
    loader2)`
method prepare_model | accelerator.prepare_model(model) | `rt.setup(model)`
method prepare_data_loader | accelerator.prepare_data_loader(loader) | `rt.setup_loader(loader)`
method backward | accelerator.backward(loss) | `rt.backward(loss)` | divides by `accumulate` as
    Accelerate does
method accumulate | with accelerator.accumulate(model): | `gk.Runtime(accumulate=N)` | no block:
    `rt.backward` skips the gradient sync and `rt.step` steps every N calls
method no_sync | with accelerator.no_sync(model): | `gk.Runtime(accumulate=N)` | the sync is
    skipped while accumulating
method clip_grad_norm_ | accelerator.clip_grad_norm_(params, max_norm) |
    `gk.Runtime(clip=max_norm)` | `rt.step` clips before each optimizer step
method autocast | with accelerator.autocast(): | `gk.Runtime(precision="bf16-mixed")` | the
    forward of the set-up model runs in autocast: no block
method gather | accelerator.gather(x) | `rt.all_gather(x).flatten(0, 1)` | `rt.all_gather`
    stacks on a new first dimension; Accelerate concatenates (a 0-d `x`: `rt.all_gather(x)`)
method gather_for_metrics | accelerator.gather_for_metrics(x) | `rt.gather_for_metrics(x)` | the
    last batch's repeated samples dropped, as Accelerate does
method reduce | accelerator.reduce(x, "sum") | `rt.all_reduce(x, op="sum")`
method pad_across_processes | accelerator.pad_across_processes(x) | `rt.pad_across_processes(x)`
method log | accelerator.log(values, step=N) | `rt.log_metrics(step=N, **values)` | recorded as
    given; `rt.log(**values)` averages over ranks and steps instead
method init_trackers | accelerator.init_trackers(name, config) | `rt.log_hyperparams(config)` |
    the loggers are `gk.Runtime(loggers=...)`
method end_training | accelerator.end_training() | `rt.teardown()` | `rt.launch` finishes the
    loggers when the function returns
method print | accelerator.print(...) | `rt.print(...)`
method wait_for_everyone | accelerator.wait_for_everyone() | `rt.barrier()`
method main_process_first | with accelerator.main_process_first(): | `with
    rt.main_process_first():`
method local_main_process_first | with accelerator.local_main_process_first(): | `with
    rt.main_process_first(local=True):`
method unwrap_model | accelerator.unwrap_model(model) | `rt.unwrap(model)`
method save_state | accelerator.save_state(folder) | `rt.save(folder)` | gpukit's checkpoint,
    not Accelerate's files
method load_state | accelerator.load_state(folder) | `rt.load(folder)` | reads gpukit's
    checkpoints; the loaders resume mid-epoch
method register_for_checkpointing | accelerator.register_for_checkpointing(obj) |
    `rt.track(name=obj)`
method skip_first_batches | accelerator.skip_first_batches(loader, n) | `rt.load(folder)` | a
    loader resumes at its next batch by itself
method save_model | accelerator.save_model(model, folder) |
    `rt.unwrap(model).save_pretrained(folder)` | or `rt.full_state_dict()`, the whole weights on
    every rank
method save | accelerator.save(obj, path) | `rt.save(path, state)` | a file written by rank 0
attribute is_main_process | accelerator.is_main_process | `rt.is_global_zero`
attribute is_local_main_process | accelerator.is_local_main_process | `rt.local_rank == 0`
attribute device | accelerator.device | `rt.device`
attribute num_processes | accelerator.num_processes | `rt.world_size`
attribute process_index | accelerator.process_index | `rt.rank`
attribute local_process_index | accelerator.local_process_index | `rt.local_rank`
attribute sync_gradients | accelerator.sync_gradients | `rt.step(optimizer)` | returns True when
    the optimizer stepped
attribute gradient_accumulation_steps | accelerator.gradient_accumulation_steps |
    `rt.accumulate`
""",
)

FABRIC = _parse(
    "fabric",
    """
function lightning.fabric.Fabric | fabric = Fabric(...) | `rt = gk.Runtime(...)`
function lightning.fabric.seed_everything | seed_everything(seed) | `gk.Runtime(seed=seed)`
keyword accelerator | Fabric(accelerator="cpu") | `gk.Runtime(devices="cpu")` | every rank on
    the CPU under a launcher
keyword devices | Fabric(devices=N) | `gk.Runtime(devices=N)`
keyword strategy | Fabric(strategy="ddp") | `gk.Runtime(strategy="ddp")` | `"fsdp"` too; others:
    [Strategies](strategies.md)
keyword precision | Fabric(precision="bf16-mixed") | `gk.Runtime(precision="bf16-mixed")`
keyword loggers | Fabric(loggers=[...]) | `gk.Runtime(loggers=[...])` | see
    [Loggers](loggers.md)
keyword num_nodes | Fabric(num_nodes=N) | `gpukit launch --nnodes N` | the nodes come from the
    launcher
method launch | fabric.launch(fn) | `rt.launch(fn)` | `fabric.launch()` with no function:
    `gpukit launch --nproc N script.py`
method setup | fabric.setup(model, optimizer) | `rt.setup(model, optimizer)`
method setup_module | fabric.setup_module(model) | `rt.setup(model)`
method setup_optimizers | fabric.setup_optimizers(optimizer) | `rt.setup(model, optimizer)` |
    given with the model
method setup_dataloaders | fabric.setup_dataloaders(loader1, loader2) | `rt.setup(loader1,
    loader2)`
method-keyword setup_dataloaders.use_distributed_sampler |
    fabric.setup_dataloaders(loader, use_distributed_sampler=False) | `gk.to(batch, rt.device)`
    | the loader kept out of `rt.setup`, which shares a loader out among several ranks: each
    rank iterates the whole data set, and moves each batch itself
method backward | fabric.backward(loss) | `rt.backward(loss)` | divides by `accumulate`: Fabric
    does not
method no_backward_sync | with fabric.no_backward_sync(model, enabled=...): |
    `gk.Runtime(accumulate=N)` | no block: `rt.step` steps every N calls
method clip_gradients | fabric.clip_gradients(model, optimizer, max_norm=m) |
    `gk.Runtime(clip=m)` | `rt.step` clips before each optimizer step
method autocast | with fabric.autocast(): | `gk.Runtime(precision="bf16-mixed")` | the forward
    of the set-up model runs in autocast: no block
method to_device | fabric.to_device(x) | `gk.to(x, rt.device)` | batches of a set-up loader are
    there already
method log | fabric.log(name, value, step=N) | `rt.log_metrics(step=N, name=value)`
method log_dict | fabric.log_dict(values, step=N) | `rt.log_metrics(step=N, **values)`
method all_gather | fabric.all_gather(x) | `rt.all_gather(x)` | stacked on a new first
    dimension, as Fabric does
method all_reduce | fabric.all_reduce(x, reduce_op="mean") | `rt.all_reduce(x, op="mean")`
method broadcast | fabric.broadcast(obj, src=0) | `rt.broadcast(obj, src=0)`
method barrier | fabric.barrier() | `rt.barrier()`
method rank_zero_first | with fabric.rank_zero_first(): | `with rt.main_process_first():`
method save | fabric.save(path, state) | `rt.save(path, state)` | one file, written by rank 0
method load | fabric.load(path, state) | `rt.load(path, state)` | returns what `state` did not
    hold, as Fabric does
method-keyword load.strict | fabric.load(path, state, strict=False) | `rt.load(path, state)` |
    always strict: every entry of `state` must be in the file and every model fit it; leave
    out of `state` what the file lacks (safetensors weights by the names both have:
    `rt.load_weights(path, model, strict=False)`)
method print | fabric.print(...) | `rt.print(...)`
method seed_everything | fabric.seed_everything(seed) | `gk.Runtime(seed=seed)`
attribute is_global_zero | fabric.is_global_zero | `rt.is_global_zero`
attribute global_rank | fabric.global_rank | `rt.rank`
attribute local_rank | fabric.local_rank | `rt.local_rank`
attribute world_size | fabric.world_size | `rt.world_size`
attribute device | fabric.device | `rt.device`
""",
)

DDP = _parse(
    "ddp",
    """
function torch.distributed.init_process_group | dist.init_process_group("nccl") | `rt =
    gk.Runtime()` | under a launcher it joins the group when made
function torch.nn.parallel.DistributedDataParallel | DistributedDataParallel(model,
    device_ids=[i]) | `rt.setup(model, optimizer)` | `strategy="auto"` is ddp under a launcher
function torch.utils.data.DistributedSampler | DistributedSampler(dataset) | `rt.setup(model,
    optimizer, loader)` | a `shuffle=True` loader is enough; your own sampler is kept
function torch.cuda.set_device | torch.cuda.set_device(local_rank) | `rt.device` | the local
    rank's GPU, chosen for you
function torch.distributed.get_rank | dist.get_rank() | `rt.rank`
function torch.distributed.get_world_size | dist.get_world_size() | `rt.world_size`
function torch.distributed.all_reduce | dist.all_reduce(t) | `t = rt.all_reduce(t, op="sum")` |
    returns the result, `t` is left as it was; the default op is `"mean"`
function torch.distributed.all_gather | dist.all_gather(tensors, t) | `rt.all_gather(t)` | one
    tensor, stacked on a new first dimension
function torch.distributed.broadcast | dist.broadcast(t, src=0) | `t = rt.broadcast(t, src=0)` |
    returns the result; any picklable object too
function torch.distributed.barrier | dist.barrier() | `rt.barrier()`
function torch.distributed.destroy_process_group | dist.destroy_process_group() |
    `rt.teardown()`
function torch.multiprocessing.spawn | mp.spawn(fn, args=(...), nprocs=N) |
    `gk.Runtime(devices=N).launch(fn, ...)` | `fn(rt, ...)`, not `fn(rank, ...)`; returns rank
    0's result
env LOCAL_RANK | int(os.environ["LOCAL_RANK"]) | `rt.local_rank`
env RANK | int(os.environ["RANK"]) | `rt.rank`
env WORLD_SIZE | int(os.environ["WORLD_SIZE"]) | `rt.world_size`
any-method set_epoch | sampler.set_epoch(epoch) | nothing to write | the loader `rt.setup`
    returns calls it before each pass; yours is kept if you call it
any-method no_sync | with model.no_sync(): | `gk.Runtime(accumulate=N)` | no block: the sync is
    skipped while accumulating
""",
)

TORCH = _parse(
    "torch",
    """
any-method backward | loss.backward() | `rt.backward(loss)` | in the run's precision, divided by
    `accumulate`
optimizer step | optimizer.step() | `rt.step(optimizer)` | steps, then zeroes the gradients,
    every `accumulate` calls
optimizer zero_grad | optimizer.zero_grad() | nothing to write | `rt.step` zeroes them
any-method cuda | model.cuda() | nothing to write | `rt.setup` places the model, and a set-up
    loader's batches arrive on `rt.device`
function torch.manual_seed | torch.manual_seed(seed) | `gk.Runtime(seed=seed)`
function torch.nn.utils.clip_grad_norm_ | torch.nn.utils.clip_grad_norm_(params, m) |
    `gk.Runtime(clip=m)` | `rt.step` clips before each optimizer step
function torch.autocast | torch.autocast("cuda", dtype=torch.bfloat16) |
    `gk.Runtime(precision="bf16-mixed")` | the set-up model runs in autocast: no block
function torch.amp.GradScaler | torch.amp.GradScaler() | `gk.Runtime(precision="16-mixed")` |
    the scaler is gpukit's
function torch.save | torch.save(state, path) | `rt.save(folder)` | every rank calls it; rank 0
    writes
function torch.load | torch.load(path) | `rt.load(folder)`
""",
)

TABLE: tuple[Translation, ...] = (*ACCELERATE, *FABRIC, *DDP, *TORCH)

# Other full names the same functions are imported by.
SAME_FUNCTION = {
    "accelerate.accelerator.Accelerator": "accelerate.Accelerator",
    "accelerate.utils.random.set_seed": "accelerate.utils.set_seed",
    "lightning.Fabric": "lightning.fabric.Fabric",
    "lightning.fabric.fabric.Fabric": "lightning.fabric.Fabric",
    "lightning.seed_everything": "lightning.fabric.seed_everything",
    "lightning.fabric.utilities.seed.seed_everything": "lightning.fabric.seed_everything",
    "pytorch_lightning.seed_everything": "lightning.fabric.seed_everything",
    "torch.nn.parallel.distributed.DistributedDataParallel": (
        "torch.nn.parallel.DistributedDataParallel"
    ),
    "torch.utils.data.distributed.DistributedSampler": "torch.utils.data.DistributedSampler",
    "torch.cuda.amp.autocast": "torch.autocast",
    "torch.amp.autocast": "torch.autocast",
    "torch.cuda.amp.GradScaler": "torch.amp.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
}
# The objects a program makes that the rows of kind "method" and "attribute" belong to.
CONSTRUCTORS: dict[str, Library] = {
    "accelerate.Accelerator": "accelerate",
    "lightning.fabric.Fabric": "fabric",
}


def rows_of(library: Library) -> list[Translation]:
    """The table's rows for ``library``, in the guide's order."""
    return [row for row in TABLE if row.library == library]


def plain(text: str) -> str:
    """``text`` without the guide's backticks and links, as the command line prints it."""
    return re.sub(r"\[([^]]+)\]\([^)]+\)", r"\1", text).replace("`", "")
