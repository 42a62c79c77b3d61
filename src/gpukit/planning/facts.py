"""What the planner's closed form needs to know of a model, measured once without its memory.

A model's states (parameters, gradients, optimizer state) follow from its parameters' shapes;
its activations do not: they depend on what each operation saves for the backward. So
:func:`model_facts` runs the forward (and the loss, when given) under fake tensors, which have
shapes and dtypes but no data, at micro-batch 1 and 2, and counts the unique storages that
autograd saves. The growth from 1 to 2 is the per-sample part, the rest the fixed part. Nothing
of the user's model changes: the forward runs on fake copies of its parameters. A model of
identical blocks runs through its first few only (:mod:`gpukit.planning.repeats`: its block
list is shortened while measuring and restored), with the same result.

Under ``activation_checkpointing`` the blocks fsdp shards and recomputes (its groups'
modules, ``find_groups``: a ``transformers`` model's ``_no_split_modules``) keep less:
``"full"`` only each block's input, plus one block's own saved tensors while it is recomputed
in the backward; ``"selective"`` also what its policy keeps (every second matrix product's
output and attention's, counted by the same :class:`Selection` that training asks), whether
the backward needs them or not.

>>> import torch
>>> from torch import nn
>>> facts = model_facts(nn.Linear(4, 2), (torch.ones(4), torch.tensor(0)))
>>> facts.trainable_bytes, facts.activation_bytes_per_sample
(40, 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.planning import repeats
from gpukit.planning.saved_tensors import ForwardRun, fake_forward, nbytes
from gpukit.strategies._groups import find_groups

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
CHECKPOINTING = ("off", "full", "selective")


@dataclass(frozen=True)
class ModelFacts:
    """A model's memory-relevant facts in bytes (see the module doc). ``parameter_rows`` holds
    each unique parameter's ``(rows, bytes per row, trains)``, what fsdp's sharding along dim
    0 needs; ``backward_bytes_*`` the gradients of activations alive at the backward's peak on
    top of what the forward saved; ``loss_bytes_per_sample`` the part of the activations the
    loss saved (under ``dp`` it sits on the first device for the whole batch)."""

    trainable_bytes: int
    frozen_bytes: int
    buffer_bytes: int
    trainable_numel: int
    largest_group_bytes: int
    activation_bytes_per_sample: int
    activation_bytes_fixed: int
    output_bytes_per_sample: int
    input_bytes_per_sample: int
    flops_per_sample: float = 0.0
    target_bytes_per_sample: int = 0
    loss_bytes_per_sample: int = 0
    backward_bytes_per_sample: int = 0
    backward_bytes_fixed: int = 0
    root_group_bytes: int = 0
    block_groups: int = 0
    activation_tensors: int = 0
    buffer_tensors: int = 0
    parameter_rows: tuple[tuple[int, int, bool], ...] = ()
    largest_block_bytes: int = 0  # the largest group but the root (0: unknown)

    def activations(self, micro_batch: int) -> int:
        """Bytes saved for the backward at ``micro_batch`` samples."""
        return max(0, self.activation_bytes_fixed + self.activation_bytes_per_sample * micro_batch)

    def backward_extra(self, micro_batch: int) -> int:
        """Gradients of activations at the backward's peak, at ``micro_batch`` samples."""
        return max(0, self.backward_bytes_fixed + self.backward_bytes_per_sample * micro_batch)


def model_facts(
    model: nn.Module,
    example: Any,
    *,
    precision: str = "32",
    activation_checkpointing: str = "off",
    flops_per_sample: float = 0.0,
    loss: Callable[..., Any] | None = None,
    param_dtype: torch.dtype | None = None,
) -> ModelFacts:
    """Measure ``model``'s facts from one ``(input, target)`` item ``example`` (see the
    module doc); ``loss(output, target)``, when given, is counted too, else the loss is
    assumed to keep one output-sized tensor (a cross entropy's log-probabilities).
    ``param_dtype``: the floating parameters computed in that dtype (FSDP2's mixed precision
    gathers them so), which the activations then are too. A model on the meta device is
    measured the same way: its parameters only give shapes."""
    if precision not in PRECISIONS:
        raise ConfigError(
            f"precision {precision!r} is not one the planner models: use one of {PRECISIONS}"
        )
    if activation_checkpointing not in CHECKPOINTING:
        raise ConfigError(
            f"activation_checkpointing={activation_checkpointing!r}: use one of {CHECKPOINTING}"
        )
    if not isinstance(example, (tuple, list)) or len(example) != 2:
        raise ConfigError(
            f"example must be one (input, target) item of the dataset, got {type(example).__name__}"
        )
    params = {id(p): p for p in model.parameters()}.values()
    trainable = [p for p in params if p.requires_grad]
    groups = find_groups(model)
    in_blocks = {id(p) for g in groups for p in g.parameters}
    group_sizes = [sum(nbytes(p) for p in g.parameters) for g in groups]
    root = sum(nbytes(p) for p in params if id(p) not in in_blocks)
    try:
        one, two = (_measure(model, example, b, precision, loss, param_dtype) for b in (1, 2))
    except ConfigError:
        raise
    except Exception as err:
        said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"the planner could not model the activations of {type(model).__name__}: its "
            f"forward failed on fake tensors (tensors without values), most likely because it "
            f"reads tensor values in Python ({type(err).__name__}: {said}). Only the model's "
            "states (parameters, gradients, optimizer state) can be predicted; run the "
            "simulation or measure a real step for the activations"
        ) from None
    act1, act2 = (r.activations(activation_checkpointing) for r in (one, two))
    bwd1, bwd2 = (r.backward_extra(activation_checkpointing) for r in (one, two))
    return ModelFacts(
        trainable_bytes=sum(nbytes(p) for p in trainable),
        frozen_bytes=sum(nbytes(p) for p in params if not p.requires_grad),
        buffer_bytes=sum(nbytes(b) for b in model.buffers()),
        trainable_numel=sum(p.numel() for p in trainable),
        largest_group_bytes=max([*group_sizes, root]),
        activation_bytes_per_sample=act2 - act1,
        activation_bytes_fixed=2 * act1 - act2,
        output_bytes_per_sample=two.output - one.output,
        input_bytes_per_sample=two.inputs - one.inputs,
        flops_per_sample=float(flops_per_sample),
        target_bytes_per_sample=two.targets - one.targets,
        loss_bytes_per_sample=two.loss - one.loss,
        backward_bytes_per_sample=bwd2 - bwd1,
        backward_bytes_fixed=2 * bwd1 - bwd2,
        root_group_bytes=root,
        block_groups=len(groups),
        activation_tensors=len(one.saved),
        buffer_tensors=sum(1 for _ in model.buffers()),
        parameter_rows=tuple(_rows(p) for p in params),
        largest_block_bytes=max(group_sizes, default=0),
    )


def recomputed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks fsdp recomputes under activation checkpointing: its groups' modules."""
    return [b for g in find_groups(model) for b in g.modules]


def _rows(p: torch.Tensor) -> tuple[int, int, bool]:
    rows = p.shape[0] if p.dim() else 1
    return rows, nbytes(p) // max(rows, 1), p.requires_grad


def _measure(
    model: nn.Module,
    example: Any,
    batch: int,
    precision: str,
    loss: Callable[..., Any] | None,
    param_dtype: torch.dtype | None,
) -> ForwardRun:
    """:func:`~gpukit.planning.saved_tensors.fake_forward`, through the first few of
    ``model``'s blocks when they are identical and are the blocks fsdp recomputes
    (:mod:`gpukit.planning.repeats`: the same saved tensors, in far less time), else through
    the whole model."""
    found = repeats.repeated_blocks(model)
    if found is not None and [id(b) for b in found[1]] == [id(b) for b in recomputed_blocks(model)]:
        container, blocks = found
        try:
            with repeats.truncated(container, repeats.MEASURED):
                run = fake_forward(
                    model, example, batch, precision, loss, param_dtype, blocks[: repeats.MEASURED]
                )
        except Exception:
            run = None  # measured whole, below
        if run is not None:
            stretched = run.stretched(len(blocks))
            if stretched is not None:
                return stretched
    return fake_forward(
        model, example, batch, precision, loss, param_dtype, recomputed_blocks(model)
    )
