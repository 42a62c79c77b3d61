"""Tensor-parallel plans read from the model: ``FSDP(tp=N)`` without a ``tp_plan``.

:func:`auto_plan` returns the dict of module names to ``ParallelStyle`` that torch's
``parallelize_module`` takes, found in this order:

1. the two decoder layouts of gpukit's own workloads (the ``gpt``/``gpt2`` one: fused ``qkv``,
   ``mlp`` as a Sequential, LayerNorms, learned positions, head tied to the token embedding;
   the ``llama`` one: ``wq/wk/wv/wo``, ``w1/w2/w3``, RMSNorms, untied or tied head). Their
   attention and MLP are split as Megatron does (column-split in, row-split out), and the
   norms run sequence parallel, as torchtitan runs Llama: between the blocks each rank holds
   ``1/tp`` of the sequence, gathered before each attention and MLP and reduce-scattered after.
   An untied output layer whose vocabulary divides by ``tp`` is column-split, and its token
   embedding row-split; a tied pair (or a vocabulary that does not divide) stays whole on every
   tensor-parallel rank (fsdp still shards it across the data-parallel ranks);
2. a ``transformers`` model's published plan (``config.base_model_tp_plan``, and the model's own
   ``_tp_plan`` for its output layer), its style names mapped to torch's styles;
3. attention and MLP modules recognised by their projections' names (``q_proj/k_proj/v_proj/
   o_proj``, ``wq/wk/wv/wo``, a fused ``qkv``/``c_attn`` with ``proj``/``c_proj``;
   ``gate_proj/up_proj/down_proj``, ``w1/w3/w2``, ``c_fc/c_proj``, ``fc1/fc2``, a Sequential of
   Linear, activation, Linear), without sequence parallelism.

An attention module's head counts (``n_head``, ``heads``, ``kv_heads``...) become the heads
each rank holds. A model none of these read raises a ConfigError that says how to give a plan.
:func:`check_tp` refuses sizes that ``tp`` does not divide, before any process group work.

>>> import torch
>>> from torch import nn
>>> class Attention(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.n_head = 4
...         self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8) for _ in "qkvo")
>>> sorted(auto_plan(nn.Sequential(Attention()), tp=2))
['0', '0.k_proj', '0.o_proj', '0.q_proj', '0.v_proj']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._tp_find import HOW_TO_PLAN, find_parts


def auto_plan(model: nn.Module, tp: int, *, loss_parallel: bool = False) -> dict[str, Any]:
    """The tensor-parallel plan of ``model`` for ``tp`` ranks (see the module doc), after
    :func:`check_tp`. With ``loss_parallel``, a column-split output layer hands its logits on
    split by vocabulary (a ``Shard(-1)`` DTensor) for :func:`loss_parallel_criterion`, instead
    of gathering them."""
    check_tp(model, tp)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from gpukit.strategies import _tp_layouts, _tp_styles

    layout = _tp_layouts.decoder_layout(model)
    if layout is not None:
        return _tp_layouts.sequence_parallel_plan(
            model, layout, tp, find_parts(model), loss_parallel
        )
    published = _tp_layouts.published_plan(model)
    if published is not None:
        return published
    found = find_parts(model)
    plan: dict[str, Any] = {}
    for a in found.attention:
        plan[a.name] = _tp_styles.LocalHeads()
        for name in a.inputs:
            plan[name] = _tp_styles.FusedQKVColwise() if a.fused else ColwiseParallel()
        plan[a.output] = RowwiseParallel()
    for m in found.mlp:
        plan.update({name: ColwiseParallel() for name in m.inputs})
        plan[m.output] = RowwiseParallel()
    return plan


def check_tp(model: nn.Module, tp: int) -> None:
    """Refuse a ``model`` that ``tp`` ranks cannot split by heads and widths: a ConfigError
    naming the module and the size (cheap; no process group needed). Also refuses a model
    whose layout :func:`auto_plan` cannot read."""
    if tp == 1:
        return
    from gpukit.strategies import _tp_layouts

    sizes: list[tuple[str, str, int]] = []
    published = _tp_layouts.published_sizes(model)
    if published is not None:
        sizes = published
    else:
        found = find_parts(model)
        if not found.attention and not found.mlp:
            raise ConfigError(
                f"tensor parallel (tp={tp}) found nothing to split in "
                f"{type(model).__name__}: no attention (q/k/v/o or fused qkv projections) "
                "and no MLP (gate/up/down, w1/w2/w3, c_fc/c_proj, fc1/fc2, Linear-act-Linear) "
                f"it recognises, and no transformers base_model_tp_plan: {HOW_TO_PLAN}"
            )
        for a in found.attention:
            sizes += [(a.name, "attention heads", a.heads), (a.name, "key/value heads", a.kv_heads)]
        sizes += [(m.name, "MLP hidden width", m.hidden) for m in found.mlp]
        sizes += _tp_layouts.vocab_sizes(model)
    for where, what, size in sizes:
        if size % tp:
            raise ConfigError(
                f"tensor parallel (tp={tp}) splits {what} across ranks, but {where or 'the model'} "
                f"of {type(model).__name__} has {size}, not a multiple of {tp}: use a tp that "
                f"divides {size}, or a model whose sizes divide by {tp}"
            )


def resolve_plan(model: nn.Module, tp: int, given: Any, *, loss_parallel: bool) -> dict[str, Any]:
    """The plan to apply: the user's own (a dict, or a function of the model) wins; None or
    ``"auto"``: :func:`auto_plan`."""
    if given is None or given == "auto":
        return auto_plan(model, tp, loss_parallel=loss_parallel)
    plan = given(model) if callable(given) and not isinstance(given, dict) else given
    if not isinstance(plan, dict) or not plan:
        raise ConfigError(
            "FSDP(tp_plan=...): give a non-empty dict of module names (wildcards allowed) "
            "to ParallelStyles, a function returning one, or 'auto'"
        )
    return plan


def parallelize(model: nn.Module, tp_mesh: Any, given: Any, *, loss_parallel: bool) -> None:
    """Split ``model`` across ``tp_mesh`` (a one-dimensional DeviceMesh) by the plan
    :func:`resolve_plan` gives: the user's ``given`` one, else :func:`auto_plan`'s."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = resolve_plan(model, tp_mesh.size(), given, loss_parallel=loss_parallel)
    parallelize_module(model, tp_mesh, plan)


def loss_parallel_criterion(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` computed on logits split by vocabulary (a ``Shard(-1)`` DTensor) under torch's
    ``loss_parallel``, forward and backward, without gathering them; other outputs go to
    ``fn`` as they are. The loss comes back a plain tensor, the same on every
    tensor-parallel rank."""
    from gpukit.strategies._loss_parallel import LossParallel

    return LossParallel(fn)
