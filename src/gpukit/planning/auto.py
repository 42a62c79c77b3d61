"""The planner's answer to ``strategy="auto"``: does ddp fit each device, else does fsdp?

Asked once, at the first ``rt.setup`` of a Runtime whose ``"auto"`` chose ddp over several devices
(see ``gpukit.runtime.strategy_at_setup``), and answered by the closed form alone (no simulation):
one evaluation for ddp, and one for fsdp only when ddp does not fit. Its facts come from the
parameters' shapes (weights, gradients, AdamW's state, the fsdp groups); the activations are
measured (one forward over fake tensors at 1 and 2 samples, as ``gk.plan`` does) only where they can
decide, when the model's states alone take more than half a device, and only from an item of a
DataLoader given to ``rt.setup``. On a GPU the CUDA context and the allocator's reserve are added,
as in a plan.

>>> import torch
>>> from gpukit.runtime.strategy_at_setup import Question
>>> small = Question(torch.nn.Linear(4, 4), 2, 2**30, "cpu", 8, 1, "32")
>>> answer(small).shard
False
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from torch import nn

from gpukit._util.text import format_bytes
from gpukit.errors import GpukitError
from gpukit.planning.closed_form import closed_form
from gpukit.planning.facts import PRECISIONS, ModelFacts, model_facts
from gpukit.planning.targets import ALLOCATOR_RESERVE_FRACTION, CUDA_CONTEXT_BYTES
from gpukit.runtime.strategy_at_setup import Answer, Question, use_estimator
from gpukit.strategies._groups import find_groups
from gpukit.strategies.auto import REPLICATED, SHARDED

__all__ = ["answer", "state_facts"]


def answer(q: Question) -> Answer:
    """Whether ``q``'s run should shard its model with fsdp rather than replicate it with ddp,
    and what to say about it (see the module doc)."""
    precision = q.precision if q.precision in PRECISIONS else "32"
    facts = state_facts(q.model)
    counted = "activations not counted"
    if _states(facts) * 2 > q.capacity:
        measured, counted = _measured(q, precision)
        facts = measured or facts
    ddp = _need(q, facts, REPLICATED, precision)
    if ddp <= q.capacity:
        return Answer(shard=False)
    fsdp = _need(q, facts, SHARDED, precision)
    per = f"per device of {format_bytes(q.capacity)}"
    if fsdp <= q.capacity:
        return Answer(
            shard=True,
            said=f"auto: ddp would need {format_bytes(ddp)} {per}; fsdp needs "
            f"{format_bytes(fsdp)}: using fsdp (the planner's closed form, {counted})",
        )
    return Answer(
        shard=False,
        said=f"auto: neither fits, by the planner's closed form ({counted}): ddp would need "
        f"{format_bytes(ddp)} {per}, fsdp {format_bytes(fsdp)}; keeping ddp. `gpukit plan` "
        "shows what fits (more devices, a smaller micro-batch, activation checkpointing, "
        "fsdp's mixed precision)",
    )


def state_facts(model: nn.Module) -> ModelFacts:
    """``model``'s facts from its parameters alone (no forward: activations 0), with the
    groups fsdp would shard it into."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = [p for p in params if p.requires_grad]
    groups = find_groups(model)
    sizes = [sum(_nbytes(p) for p in g.parameters) for g in groups]
    in_blocks = {id(p) for g in groups for p in g.parameters}
    root = sum(_nbytes(p) for p in params if id(p) not in in_blocks)
    return ModelFacts(
        trainable_bytes=sum(_nbytes(p) for p in trainable),
        frozen_bytes=sum(_nbytes(p) for p in params if not p.requires_grad),
        buffer_bytes=sum(_nbytes(b) for b in model.buffers()),
        trainable_numel=sum(p.numel() for p in trainable),
        largest_group_bytes=max([*sizes, root]),
        activation_bytes_per_sample=0,
        activation_bytes_fixed=0,
        output_bytes_per_sample=0,
        input_bytes_per_sample=0,
        root_group_bytes=root,
        block_groups=len(groups),
        parameter_rows=tuple(_rows(p) for p in params),
        largest_block_bytes=max(sizes, default=0),
    )


def _states(facts: ModelFacts) -> int:
    """Weights, gradients and AdamW's two float32 states, replicated."""
    weights = facts.trainable_bytes + facts.frozen_bytes + facts.buffer_bytes
    return weights + facts.trainable_bytes + 8 * facts.trainable_numel


def _measured(q: Question, precision: str) -> tuple[ModelFacts | None, str]:
    """The facts with the activations, and what was counted (in words)."""
    example = q.example() if q.micro_batch else None
    if example is None:
        return None, "activations not counted: no map-style DataLoader given to rt.setup"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            facts = model_facts(q.model, example, precision=precision)
    except GpukitError:
        return None, "activations not counted: the forward could not run on fake tensors"
    return facts, f"activations at {q.micro_batch} per micro-batch"


def _need(q: Question, facts: ModelFacts, strategy: str, precision: str) -> int:
    """The largest device's predicted peak under ``strategy``, with a GPU's overheads."""
    peaks = closed_form(
        facts,
        strategy=strategy,
        devices=q.devices,
        micro_batch=max(1, q.micro_batch),
        accumulate=q.accumulate,
        precision=precision,
        granularity=512 if q.kind == "cuda" else 1,
    )
    tensors = max(p.tensor_bytes for p in peaks)
    if q.kind != "cuda":
        return tensors
    return tensors + int(tensors * ALLOCATOR_RESERVE_FRACTION) + CUDA_CONTEXT_BYTES


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _rows(p: Any) -> tuple[int, int, bool]:
    rows = p.shape[0] if p.dim() else 1
    return rows, _nbytes(p) // max(rows, 1), bool(p.requires_grad)


use_estimator(answer)
