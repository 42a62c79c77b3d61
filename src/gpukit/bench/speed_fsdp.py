"""The sharded loops :mod:`gpukit.bench.speed` times: Llama 3.2 1B's shape trained under FSDP2
on the same batches, from the same weights, with the same optimizer, three ways.

- ``fsdp2``: plain PyTorch written the way torchtitan's trainer writes it: the model built on
  the meta device, ``fully_shard`` on each block and then on the root (on a GPU with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, and each block
  compiled before it is sharded where asked), ``to_empty`` on the device and the weights
  drawn, ``loss.backward()``, ``optimizer.step()``, ``zero_grad()``, and the loss read back at
  every ``log_every``-th step;
- ``runtime``: ``gk.Runtime(strategy=FSDP(mixed="bf16"))`` (no ``mixed`` on a CPU) in a user's
  loop, with the plain loop's compile: ``rt.setup(model, optimizer, loader)``,
  ``rt.backward``, ``rt.step``, ``rt.log(loss=loss)``;
- ``train``: ``gpukit train --strategy fsdp --fsdp-mixed bf16``'s loop with its default
  settings (``--precision auto``'s autocast included) and the compile its ``--compile auto``
  chooses for a long run: ``rt.train_step`` then ``rt.log(loss=loss)``.

Every loop uses torchtitan's AdamW (weight decay 0.1 on every parameter, betas 0.9 and 0.95,
fused on a GPU) and no gradient clipping, so the loop is all that differs. The plain loop's
weights are drawn as gk.Runtime draws a meta-device model's (each module's
``reset_parameters`` seeded from the run's seed and the module's name,
:mod:`gpukit.strategies.meta_init`), so the three start equal. FSDP2 needs a process group:
over one device, a group of one made in this process (:func:`process_group`).

>>> import torch
>>> setup = Setup(torch.device("cpu"), TINY, batch=2, compile=False, log_every=1,
...               model="llama", seq_len=16)
>>> with process_group(setup.device):
...     loop = fsdp2_loop(setup)
...     loop(make_batches(setup, 2))
...     loop.close()
>>> len(loop.losses)
2
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpukit.bench.speed_loops import Batch, Loop, Setup, make_batches, runtime_loop_of
from gpukit.bench.train_defaults import runtime_settings
from gpukit.runtime.runtime import Runtime
from gpukit.strategies import FSDP
from gpukit.strategies.meta_init import MetaInit
from gpukit.train import fast

__all__ = ["BUILDERS", "TINY", "make_batches", "process_group"]

SEED = 0  # the weights' seed, as gk.Runtime(seed=None) draws a meta-device model's
LR = 3e-4  # the llama workload's
WEIGHT_DECAY = 0.1  # torchtitan's, on every parameter
BETAS = (0.9, 0.95)
# The CPU's size of the Llama shape (--quick): two narrow blocks and a small vocabulary.
TINY: dict[str, Any] = {
    "layers": 2,
    "dim": 64,
    "heads": 4,
    "kv_heads": 2,
    "hidden": 128,
    "vocab": 512,
}


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """A process group of one in this process (nccl on a GPU, gloo on a CPU, its store in
    memory: no port), unless one exists; destroyed after if it was made here."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def titan_optimizer(model: nn.Module, device: torch.device) -> torch.optim.AdamW:
    """torchtitan's AdamW: weight decay on every parameter, fused on a GPU (where this
    torch takes it for a model still on the meta device, see gpukit.train.fast)."""
    fused = fast.fused_adamw(device, model.parameters())
    return torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=fused or None
    )


def fsdp2_loop(setup: Setup, batches: Sequence[Batch] = ()) -> Loop:
    """The plain FSDP2 loop (see the module docstring); ``batches`` is unused."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = setup.device
    workload = setup.workload()
    model = workload.model  # on the meta device
    mixed: dict[str, Any] = {}
    if device.type == "cuda":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        mixed = {"mp_policy": policy}
    blocks: nn.ModuleList = model.layers  # type: ignore[assignment]
    for block in blocks:
        if setup.compile:
            block.compile()
        fully_shard(block, **mixed)
    fully_shard(model, **mixed)
    MetaInit(None, SEED).materialise(model, device)  # to_empty, then the seeded draw
    optimizer = titan_optimizer(model, device)
    loop = Loop(lambda batches: None)
    step = 0

    def train(batches: Sequence[Batch]) -> None:
        nonlocal step
        for x, y in batches:
            x = x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x
            y = y.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else y
            loss = workload.loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loop.keep(loss)
            if step % setup.log_every == 0:
                loop.losses.append(loss.item())
            step += 1

    loop.run = train
    return loop


def _strategy(device: torch.device) -> FSDP:
    """FSDP with FSDP2's bf16 mixed precision on a GPU (``--fsdp-mixed bf16``); none on a CPU."""
    return FSDP(mixed="bf16" if device.type == "cuda" else None)


def runtime_fsdp_loop(setup: Setup, batches: Sequence[Batch]) -> Loop:
    """``gk.Runtime`` with FSDP in a user's loop, with the plain loop's compile."""
    rt = Runtime(
        strategy=_strategy(setup.device),
        devices=str(setup.device),
        compile=setup.compile,
        log_every=setup.log_every,
    )
    workload = setup.workload()
    optimizer = titan_optimizer(workload.model, setup.device)
    return runtime_loop_of(rt, workload.model, optimizer, workload.loss, batches, train_step=False)


def train_fsdp_loop(setup: Setup, batches: Sequence[Batch]) -> Loop:
    """``gpukit train --strategy fsdp --fsdp-mixed bf16``'s loop and default settings."""
    workload = setup.workload()
    model = workload.model
    chosen = fast.compile_choice(
        "auto",
        cuda=setup.device.type == "cuda",
        strategy="fsdp",
        devices=1,
        steps=fast.COMPILE_FROM_STEPS,
        parameters=sum(p.numel() for p in model.parameters()),
    )
    settings = runtime_settings(devices=str(setup.device))
    rt = Runtime(**{**settings, "strategy": _strategy(setup.device)}, compile=chosen.setting)
    optimizer = titan_optimizer(model, setup.device)
    return runtime_loop_of(rt, model, optimizer, workload.loss, batches, train_step=True)


BUILDERS: dict[str, Callable[[Setup, Sequence[Batch]], Loop]] = {
    "fsdp2": fsdp2_loop,
    "runtime": runtime_fsdp_loop,
    "train": train_fsdp_loop,
}
