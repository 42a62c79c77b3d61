"""The layouts ``tensor_plans.auto_plan`` knows whole: gpukit's decoders (split with sequence
parallel norms) and ``transformers`` models that publish their own plan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._tp_find import Found

_NORMS = (nn.LayerNorm, nn.RMSNorm)


@dataclass(frozen=True)
class Decoder:
    """Where a gpukit-shaped decoder keeps its parts."""

    embedding: str
    blocks: str
    norm: str
    head: str
    first_block_args: int  # arguments of a block's forward (the llama one takes cos and sin)
    blocks_run_themselves: bool  # a Sequential (called once) rather than a ModuleList


_GPT = Decoder("token_embedding", "blocks", "ln_f", "head", 1, True)
_LLAMA = Decoder("tok_embeddings", "layers", "norm", "output", 3, False)
_GPT_BLOCK = {"ln1": _NORMS, "attn": nn.Module, "ln2": _NORMS, "mlp": nn.Sequential}
_LLAMA_BLOCK = {
    "attention_norm": _NORMS,
    "attention": nn.Module,
    "ffn_norm": _NORMS,
    "w1": nn.Linear,
    "w2": nn.Linear,
    "w3": nn.Linear,
}


def decoder_layout(model: nn.Module) -> Decoder | None:
    """The gpt or llama layout when ``model`` has exactly its parts, else None."""
    for layout, block in ((_GPT, _GPT_BLOCK), (_LLAMA, _LLAMA_BLOCK)):
        parts = dict(model.named_children())
        blocks = parts.get(layout.blocks)
        if not (
            isinstance(parts.get(layout.embedding), nn.Embedding)
            and isinstance(parts.get(layout.norm), _NORMS)
            and isinstance(parts.get(layout.head), nn.Linear)
            and isinstance(blocks, (nn.Sequential, nn.ModuleList))
            and len(blocks) > 0
        ):
            continue
        if all(_has(b, block) for b in blocks):
            return layout
    return None


def _has(module: nn.Module, parts: dict[str, Any]) -> bool:
    children = dict(module.named_children())
    return set(children) == set(parts) and all(
        isinstance(children[n], kind) for n, kind in parts.items()
    )


def _vocab_split(model: nn.Module, layout: Decoder) -> bool:
    """Whether the embedding and output layer are split by vocabulary: llama's, untied only
    (splitting a tied pair's one weight for two layers would make it two). Gpt's pair is tied
    in every workload, and its learned positions are added to the embedding's whole output."""
    embedding, head = getattr(model, layout.embedding), getattr(model, layout.head)
    return layout is _LLAMA and embedding.weight is not head.weight


def vocab_sizes(model: nn.Module) -> list[tuple[str, str, int]]:
    """The vocabulary as a size ``tp`` must divide, where the plan splits it."""
    layout = decoder_layout(model)
    if layout is None or not _vocab_split(model, layout):
        return []
    return [(layout.head, "the vocabulary", getattr(model, layout.head).out_features)]


def sequence_parallel_plan(
    model: nn.Module, layout: Decoder, tp: int, found: Found, loss_parallel: bool
) -> dict[str, Any]:
    """Megatron's split of each block plus sequence-parallel norms (see ``tensor_plans``).
    Between the blocks each rank holds its ``1/tp`` of the sequence as a local tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from gpukit.strategies._tp_styles import FusedQKVColwise, LocalHeads

    plan: dict[str, Any] = {}
    if _vocab_split(model, layout):
        plan[layout.embedding] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
        plan[layout.head] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    else:  # the whole sequence in, each rank's piece out; the head gathers it back
        rest = (None,) * (layout.first_block_args - 1)
        entry = layout.blocks if layout.blocks_run_themselves else f"{layout.blocks}.0"
        plan[entry] = PrepareModuleInput(
            input_layouts=(Replicate(), *rest),
            desired_input_layouts=(Shard(1), *rest),
            use_local_output=True,
        )
        plan[layout.head] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    plan[layout.norm] = SequenceParallel()
    for a in found.attention:
        plan[a.name] = LocalHeads(sequence_parallel=True, args=layout.first_block_args)
        for name in a.inputs:
            plan[name] = FusedQKVColwise() if a.fused else ColwiseParallel()
        plan[a.output] = RowwiseParallel(output_layouts=Shard(1))
    for m in found.mlp:
        if m.own_module:  # one gather for the module's projections
            plan[m.name] = PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            )
            plan.update({name: ColwiseParallel() for name in m.inputs})
        else:
            plan.update({name: ColwiseParallel(input_layouts=Shard(1)) for name in m.inputs})
        plan[m.output] = RowwiseParallel(output_layouts=Shard(1))
    for name, module in model.named_modules():
        if name.startswith(f"{layout.blocks}.") and isinstance(module, _NORMS):
            plan[name] = SequenceParallel()
    return plan


# transformers' style names -> torch's styles (transformers' own ParallelInterface). The ones
# that need transformers' own layers (packed, experts, local...) are refused by name.
def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
    }


def _published(model: nn.Module) -> tuple[dict[str, str], str] | None:
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not isinstance(base, dict) or not base:
        return None
    prefix_name = getattr(model, "base_model_prefix", "")
    inner = getattr(model, prefix_name, None) if prefix_name else None
    prefix = f"{prefix_name}." if isinstance(inner, nn.Module) else ""
    plan = {prefix + k: v for k, v in base.items()}
    head_plan = getattr(model, "_tp_plan", None) or {}
    tied = getattr(config, "tie_word_embeddings", False)
    if not tied:  # a tied head stays whole: splitting it would untie it from the embedding
        plan.update({k: v for k, v in head_plan.items() if k not in plan})
    return plan, type(model).__name__


def published_plan(model: nn.Module) -> dict[str, Any] | None:
    """A ``transformers`` model's own plan in torch's styles, or None if it has none."""
    found = _published(model)
    if found is None:
        return None
    plan, name = found
    styles = _styles()
    unknown = {k: v for k, v in plan.items() if v not in styles}
    if unknown:
        given = ", ".join(f"{k!r}: {v!r}" for k, v in unknown.items())
        raise ConfigError(
            f"{name}'s base_model_tp_plan uses styles gpukit cannot map to torch's ({given}; "
            f"it maps {', '.join(styles)}): give FSDP(tp=N, tp_plan={{...}}) with torch's "
            "ColwiseParallel / RowwiseParallel for those modules"
        )
    return {k: styles[v] for k, v in plan.items()}


def published_sizes(model: nn.Module) -> list[tuple[str, str, int]] | None:
    """The sizes a published plan splits, read from the model's config."""
    found = _published(model)
    if found is None:
        return None
    plan, _ = found
    config = model.config
    sizes = []
    for attr, what in (
        ("num_attention_heads", "attention heads"),
        ("num_key_value_heads", "key/value heads"),
        ("intermediate_size", "MLP hidden width"),
    ):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            sizes.append(("", what, value))
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and any("head" in k or "embed" in k for k in plan):
        sizes.append(("", "the vocabulary", vocab))
    return sizes
