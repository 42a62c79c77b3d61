"""How ``tensor_plans`` recognises attention and MLP modules: by their projections' names
(see ``tensor_plans`` for the names), and the head counts each one names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from gpukit.errors import ConfigError

_SEPARATE = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"))
_FUSED = (("qkv", "proj"), ("c_attn", "c_proj"))
_GATED = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_PLAIN = (("c_fc", "c_proj"), ("fc1", "fc2"))

# The attributes an attention module keeps its head counts in, across common code bases.
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "heads", "num_attention_heads")
KV_HEAD_COUNTS = ("n_kv_head", "n_kv_heads", "kv_heads", "num_key_value_heads", "num_kv_heads")

HOW_TO_PLAN = (
    "give FSDP(tp=N, tp_plan={...}): module names (wildcards allowed) to torch's "
    "ColwiseParallel / RowwiseParallel (torch.distributed.tensor.parallel), or a function "
    "model -> such a dict"
)


@dataclass
class Attention:
    """An attention module: its name, its projections' names, and its head counts."""

    name: str
    inputs: list[str]  # column-split projections (one when fused)
    output: str  # the row-split projection
    fused: bool
    heads: int
    kv_heads: int


@dataclass
class MLP:
    """An MLP: the module holding its projections, their names, and its hidden width."""

    name: str  # the module holding the projections
    inputs: list[str]
    output: str
    hidden: int
    own_module: bool  # the projections are the whole module (a Sequential, an "mlp")


@dataclass
class Found:
    """What :func:`find_parts` recognised in a model."""

    attention: list[Attention] = field(default_factory=list)
    mlp: list[MLP] = field(default_factory=list)


def find_parts(model: nn.Module) -> Found:
    """The attention and MLP modules of ``model``, recognised by their projections' names."""
    found = Found()
    config = getattr(model, "config", None)
    for name, module in model.named_modules():
        children = dict(module.named_children())
        prefix = f"{name}." if name else ""
        for q, k, v, o in _SEPARATE:
            if all(isinstance(children.get(n), nn.Linear) for n in (q, k, v, o)):
                heads, kv = _heads(module, name, config, children[q], children[k])
                inputs = [prefix + n for n in (q, k, v)]
                found.attention.append(Attention(name, inputs, prefix + o, False, heads, kv))
        for qkv, o in _FUSED:
            fused, out = children.get(qkv), children.get(o)
            if (
                isinstance(fused, nn.Linear)
                and isinstance(out, nn.Linear)
                and fused.out_features == 3 * out.in_features
            ):
                heads, _ = _heads(module, name, config, out, None, fused=True)
                attn = Attention(name, [prefix + qkv], prefix + o, True, heads, heads)
                found.attention.append(attn)
        for names in (*_GATED, *_PLAIN):
            *ups, down = names
            if all(isinstance(children.get(n), nn.Linear) for n in names):
                hidden = children[down].in_features
                own = set(children) <= {*names, "act", "act_fn", "activation", "dropout"}
                found.mlp.append(MLP(name, [prefix + n for n in ups], prefix + down, hidden, own))
        if isinstance(module, nn.Sequential):
            linears = [(n, c) for n, c in children.items() if isinstance(c, nn.Linear)]
            if len(linears) == 2 and _is_mlp(linears[0][1], linears[1][1]):
                (up, first), (down, _) = linears
                found.mlp.append(MLP(name, [prefix + up], prefix + down, first.out_features, True))
    return found


def _is_mlp(first: nn.Linear, second: nn.Linear) -> bool:
    return first.out_features == second.in_features and first.in_features == second.out_features


def _heads(
    module: nn.Module,
    name: str,
    config: Any,
    q: nn.Linear,
    k: nn.Linear | None,
    *,
    fused: bool = False,
) -> tuple[int, int]:
    def first(owner: Any, names: tuple[str, ...]) -> int | None:
        for n in names:
            value = getattr(owner, n, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    width = q.in_features if fused else q.out_features
    heads = first(module, HEAD_COUNTS) or first(config, HEAD_COUNTS)
    head_dim = getattr(module, "head_dim", None)
    if heads is None and isinstance(head_dim, int) and head_dim > 0:
        heads = width // head_dim
    if heads is None:
        raise ConfigError(
            f"tensor parallel splits attention by heads, but {name or 'the model'} "
            f"({type(module).__name__}) names no head count (n_head, num_heads, heads, "
            f"num_attention_heads, or head_dim) for auto_plan to read: {HOW_TO_PLAN}"
        )
    kv = first(module, KV_HEAD_COUNTS) or first(config, KV_HEAD_COUNTS)
    if kv is None:
        kv = heads if k is None else k.out_features // (width // heads)
    return heads, kv
