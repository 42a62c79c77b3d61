"""What ``gpukit train`` uses on a GPU to run as fast as a hand-tuned loop.

``gk.Runtime`` keeps a program's own choices; ``gpukit train`` is gpukit's own program and picks
what a tuned loop such as nanoGPT's ``train.py`` uses on a GPU. Besides bf16 mixed precision
(``--precision auto``) and batches prefetched on a side stream (every ``rt.setup`` loader):

- TF32 matmuls and convolutions (:func:`tf32`): what float32 work remains runs on the tensor
  cores, with float32's range and a 10-bit mantissa;
- fused AdamW (:func:`fused_adamw`): one kernel for the whole update instead of a few per
  tensor list;
- ``torch.compile`` when the run is long enough to repay compiling (:func:`compile_choice`,
  ``--compile auto``), with CUDA graphs ("reduce-overhead") for a small model on one GPU,
  whose kernels are too short to keep the GPU busy between the host's launches.

On a CPU none of them applies: a CPU run computes what a plain loop computes, bit for bit.

>>> compile_choice("auto", cuda=False, strategy="single", devices=1, steps=10_000,
...                parameters=1_000)
Compile(setting=False, why='eager: compiling pays off on a GPU, and this run trains on a CPU')
>>> compile_choice("auto", cuda=True, strategy="single", devices=1, steps=100, parameters=1_000)
Compile(setting=False, why='eager: 100 steps are too few to repay compiling (auto compiles \
from 500; --compile on to compile anyway)')
>>> compile_choice("auto", cuda=True, strategy="single", devices=1, steps=5_000,
...                parameters=1_000).setting
'reduce-overhead'
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.optim import optimizer as optimizer_module

from gpukit.runtime.compiling import MODES

# What --compile takes: auto (decided below), on (torch's default), off, or one of its modes.
COMPILE_CHOICES = ("auto", "on", "off", *MODES)
# Auto compiles from this many optimizer steps: compiling a model takes from tens of seconds
# (a small model) to minutes (GPT-2 with its backward), which a shorter run does not win back.
COMPILE_FROM_STEPS = 500
# Auto records CUDA graphs for models up to this size on one GPU: below it a step's kernels are
# short enough that launching them from the host, not the GPU's work, sets the pace.
GRAPHS_UP_TO_PARAMETERS = 20_000_000
# Strategies that cannot compile: they copy the model onto every device at each step.
_NOT_COMPILED = ("dp", "dp-balanced")


@dataclass(frozen=True)
class Compile:
    """The Runtime's ``compile`` setting a run uses, and why, in words for its summary."""

    setting: bool | str
    why: str


def parse_compile(text: str) -> str:
    """``--compile``'s value: one of :data:`COMPILE_CHOICES`; a config file's true and false
    (from before the flag took a value) read as on and off.

    >>> parse_compile("true"), parse_compile("reduce-overhead")
    ('on', 'reduce-overhead')
    """
    lowered = text.strip().lower()
    return {"true": "on", "false": "off"}.get(lowered, lowered)


def compile_choice(
    asked: str,
    *,
    cuda: bool,
    strategy: str,
    devices: int,
    steps: int,
    parameters: int,
    fixed_shapes: bool = True,
) -> Compile:
    """What ``--compile asked`` makes of a run on ``devices`` devices (``cuda``: GPUs) under
    ``strategy`` for ``steps`` optimizer steps of a model of ``parameters``; ``fixed_shapes``:
    every step is one forward of the whole batch (no accumulation, no ``--oom recover``), which
    CUDA graphs need."""
    if asked == "off":
        return Compile(False, "off (--compile off)")
    if asked == "on":
        return Compile(True, "on (--compile on)")
    if asked != "auto":
        return Compile(asked, f"{asked} (--compile {asked})")
    if not cuda:
        return Compile(False, "eager: compiling pays off on a GPU, and this run trains on a CPU")
    if strategy in _NOT_COMPILED:
        return Compile(False, f"eager: --strategy {strategy} copies the model every step")
    if steps < COMPILE_FROM_STEPS:
        return Compile(
            False,
            f"eager: {steps} steps are too few to repay compiling (auto compiles from "
            f"{COMPILE_FROM_STEPS}; --compile on to compile anyway)",
        )
    one_gpu = devices == 1 and strategy in ("auto", "single")
    if one_gpu and fixed_shapes and parameters <= GRAPHS_UP_TO_PARAMETERS:
        return Compile(
            "reduce-overhead",
            f"reduce-overhead: {steps} steps of a small model ({parameters:,} parameters) on "
            "one GPU, replayed as CUDA graphs",
        )
    return Compile(True, f"on: {steps} steps repay compiling")


def fused_adamw(device: torch.device, parameters: Iterable[torch.Tensor] = ()) -> bool:
    """Whether gpukit train's AdamW is the fused one: on CUDA, where it is one kernel; on a
    CPU the default, so that a CPU run computes what a plain loop computes. A model still on
    the meta device (materialised at ``rt.setup``) gets it only from a torch that checks the
    fused kernel's devices at the first step rather than when the optimizer is made."""
    if device.type != "cuda":
        return False
    checked_late = hasattr(optimizer_module, "_device_dtype_check_for_fused")
    return checked_late or not any(p.is_meta for p in parameters)


@contextlib.contextmanager
def tf32(device: torch.device) -> Iterator[bool]:
    """TF32 matmuls and convolutions while the run trains on CUDA (yields whether they are
    on); the process's own switches are put back after, as they were."""
    if device.type != "cuda":
        yield False
        return
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("high")  # TF32 where float32 matmuls remain
    torch.backends.cudnn.allow_tf32 = True  # torch's default for convolutions, kept on
    try:
        yield True
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn
