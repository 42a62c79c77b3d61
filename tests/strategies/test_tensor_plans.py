"""Tensor parallel without a plan: ``FSDP(tp=N)`` reads the plan from the model
(``gpukit.strategies.tensor_plans``): gpukit's gpt and llama decoders, a small ``transformers``
Llama (its published plan) and a user's model read by its projections' names. Each run trains
10 AdamW steps over gloo ranks and is compared with the same steps in one process.

Float32 throughout, as the workloads train: a row-split Linear adds ``tp`` partial matrix
products where one process computes one, and sequence-parallel norms reduce their weights'
gradients across ranks, so the last bits differ by reduction order, and AdamW, which divides
each gradient by its running size, carries such differences into the weights at up to a few
1e-6 after 10 steps. Measured (the largest over these runs): losses within 1e-6, weights
within 6e-6. The tolerance is 3e-5 (rtol and atol), far below what a wrong split (q rows read
as k, a head cut in two, a gradient counted twice) moves: the updates themselves, ~1e-1.

One exception: the key bias of gpt's attention. Softmax ignores a constant added to all of a
row's scores, so that bias's gradient is zero in exact arithmetic, and what each run computes
is rounding noise, which AdamW scales up to steps of its learning rate: both runs move it by
noise (measured: 1e-4 apart), and it is compared to 1e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies.tensor_plans import auto_plan, check_tp
from gpukit.workloads.gpt import GPT, GPTConfig, SequenceCrossEntropy
from gpukit.workloads.llama import Llama, LlamaShape

# One worker runs the module: the 2-rank launch the three models' tests read is made once.
pytestmark = pytest.mark.xdist_group("tensor-plans")

STEPS, BATCH, SEQ, LR = 10, 4, 16, 1e-2
TOLERANCE = {"rtol": 3e-5, "atol": 3e-5}
VOCAB = 64


def _gpt() -> nn.Module:
    config = GPTConfig(vocab_size=65, context=SEQ, n_layer=2, n_head=4, d_model=32)
    return GPT(config)


def _llama() -> nn.Module:
    shape = LlamaShape(dim=32, layers=2, heads=4, kv_heads=2, hidden=64, vocab=VOCAB)
    return Llama(shape, max_seq_len=SEQ)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


class _UserAttention(nn.Module):
    """A user's grouped-query attention that reshapes by its own head counts."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.n_kv_heads, self.head_dim = 4, 2, 8
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.k_proj = nn.Linear(32, 16, bias=False)
        self.v_proj = nn.Linear(32, 16, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            for p in (self.k_proj, self.v_proj)
        )
        repeat = self.num_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class _UserMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(32, 64), nn.Linear(32, 64)
        self.down_proj = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _UserModel(nn.Module):
    """Llama-shaped, with names none of gpukit's layouts use: read by its projections' names."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.attn = nn.ModuleList(_UserAttention() for _ in range(2))
        self.mlp = nn.ModuleList(_UserMLP() for _ in range(2))
        self.norm = nn.RMSNorm(32)
        self.lm_head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for attn, mlp in zip(self.attn, self.mlp, strict=True):
            x = x + attn(self.norm(x))
            x = x + mlp(x)
        return self.lm_head(self.norm(x))  # type: ignore[no-any-return]


class _HFLogits(nn.Module):
    """A transformers causal LM called as the workloads' models are: ids in, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits  # type: ignore[no-any-return]


MODELS = {"gpt": _gpt, "llama": _llama, "hf-llama": _hf_llama, "user": _UserModel}


def _model(kind: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MODELS[kind]()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _train(rt: gk.Runtime, kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = rt.setup(model, optimizer)
    # The transformers model is parallelized as its own published plan names it: inside.
    runnable = _HFLogits(model) if kind == "hf-llama" else model
    criterion = rt.setup_criterion(SequenceCrossEntropy())
    shards, shard = rt.strategy.sampler_placement()
    losses, logits = [], ""
    for step in range(STEPS):
        x, y = _batch(step)
        n = BATCH // shards
        x, y = x[shard * n : (shard + 1) * n], y[shard * n : (shard + 1) * n]
        out = runnable(x)
        logits = logits or f"{type(out).__name__} {getattr(out, 'placements', '')}"
        loss = criterion(out, y)
        rt.backward(loss)
        rt.step(optimizer)
        seen = loss.detach().clone()
        dist.all_reduce(seen)  # the mean over the data-parallel pieces (tp ranks agree)
        losses.append(seen.item() / rt.world_size)
    state = rt.unwrap(model).state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}
    state = {k: v.detach().clone() for k, v in full.items()}
    return {"losses": losses, "state": state, "logits": logits}


def _reference(kind: str) -> dict[str, Any]:
    model = _model(kind)
    runnable = _HFLogits(model) if kind == "hf-llama" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = SequenceCrossEntropy()(runnable(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def _assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(want["losses"]), **TOLERANCE
    )
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        mine = got["state"][key]
        if key.endswith("attn.qkv.bias"):  # the key bias trains on noise (see the module doc)
            q, k, v = mine.chunk(3)
            q_want, k_want, v_want = value.chunk(3)
            torch.testing.assert_close(k, k_want, rtol=0, atol=1e-3)
            mine, value = torch.cat((q, v)), torch.cat((q_want, v_want))
        torch.testing.assert_close(mine, value, **TOLERANCE, msg=key)
    initial = got["initial"]
    moved = max((want["state"][k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-3  # the steps trained: a run that did nothing would not pass as equal


def _train_each(rt: gk.Runtime, kinds: list[str]) -> dict[str, dict[str, Any]]:
    return {kind: _train(rt, kind) for kind in kinds}


def _run(kinds: list[str], devices: int, **options: Any) -> dict[str, dict[str, Any]]:
    """Each model of ``kinds`` trained in turn in one launch (processes start once)."""
    strategy = gk.strategies.FSDP(tp=2, **options)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * devices, seed=0)
    got: dict[str, dict[str, Any]] = rt.launch(_train_each, kinds)
    for kind in kinds:
        got[kind]["initial"] = _model(kind).state_dict()
    return got


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, dict[str, Any]]:
    return _run(list(MODELS), 2)


@pytest.mark.processes
@pytest.mark.parametrize("kind", list(MODELS))
def test_tp2_auto_plan_trains_as_one_process(
    kind: str, two_ranks: dict[str, dict[str, Any]]
) -> None:
    _assert_same_training(two_ranks[kind], _reference(kind))


@pytest.mark.processes
def test_gpt_on_two_shards_times_two_tensor_parallel_ranks() -> None:
    _assert_same_training(_run(["gpt"], 4)["gpt"], _reference("gpt"))


@pytest.mark.processes
def test_loss_parallel_keeps_the_logits_split_and_trains_the_same() -> None:
    got = _run(["llama"], 2, loss_parallel=True)["llama"]
    assert got["logits"] == "DTensor (Shard(dim=2),)"  # never gathered: the loss reads shards
    _assert_same_training(got, _reference("llama"))


class _NanoGPTAttention(nn.Module):
    """nanoGPT's attention: its head width from its input's width, ``C // n_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.n_embd = 4, 32
        self.c_attn, self.c_proj = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).contiguous().view(b, t, c))  # type: ignore[no-any-return]


def _refusals(rt: gk.Runtime) -> list[str]:
    said = []
    for model in (nn.Sequential(nn.Conv1d(4, 4, 1)), nn.Sequential(_NanoGPTAttention())):
        try:  # both ranks fail at the same point, after the same collectives
            rt.setup(model)(torch.randn(2, 8, 32))
        except ConfigError as err:
            said.append(str(err))
    return said


@pytest.mark.processes
def test_fsdp_tp_without_a_plan_refuses_what_it_cannot_split() -> None:
    rt = gk.Runtime(strategy=gk.strategies.FSDP(tp=2), devices=["cpu"] * 2)
    unreadable, by_width = rt.launch(_refusals)
    assert "found nothing to split in Sequential" in unreadable and "tp_plan" in unreadable
    # Its split is right, but its forward reshapes by the input's width: a clear refusal.
    assert "_NanoGPTAttention 1/2 of its heads" in by_width and "head_dim" in by_width


# -- plans and refusals (no processes) ---------------------------------------------------------
def test_the_gpt_plan_splits_whole_heads_and_keeps_the_tied_head_whole() -> None:
    plan = auto_plan(_model("gpt"), tp=2)
    assert type(plan["blocks.0.attn.qkv"]).__name__ == "FusedQKVColwise"
    assert type(plan["blocks.1.mlp.2"]).__name__ == "RowwiseParallel"
    assert type(plan["ln_f"]).__name__ == "SequenceParallel"
    assert "token_embedding" not in plan  # tied to the head: stays whole


def test_heads_that_tp_does_not_divide_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"tp=3.*attention heads.*has 4, not a multiple of 3"):
        check_tp(_model("llama"), 3)


def test_a_model_without_attention_or_mlp_is_refused_with_how_to_give_a_plan() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    with pytest.raises(ConfigError, match=r"found nothing to split in Sequential.*tp_plan"):
        auto_plan(model, 2)


def test_a_published_style_gpukit_cannot_map_is_refused_by_name() -> None:
    model = _hf_llama()
    model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM's base_model_tp_plan.*packed_colwise"):
        auto_plan(model, 2)


def test_transformers_gpt2_without_a_published_plan_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4)
    # Its Conv1D layers are not Linear: torch's styles cannot split them.
    with pytest.raises(ConfigError, match=r"nothing to split in GPT2LMHeadModel.*tp_plan"):
        auto_plan(GPT2LMHeadModel(config), 2)


def test_a_bad_tp_plan_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tp_plan=3.*'auto'"):
        gk.strategies.FSDP(tp=2, tp_plan=3)


def test_loss_parallel_without_tensor_parallel_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"FSDP\(loss_parallel=True\) was given with tp=1"):
        gk.strategies.FSDP(loss_parallel=True)


def test_the_gpt_attention_gives_the_numbers_it_gave_with_n_head() -> None:
    # The attention reads heads from the projection's width now: the same numbers as
    # nanoGPT's split by n_head (computed here the old way) and the same state_dict keys.
    model = _model("gpt")
    attn = model.blocks[0].attn  # type: ignore[index]
    x = torch.randn(2, SEQ, 32, generator=torch.Generator().manual_seed(1))
    q, k, v = attn.qkv(x).split(32, dim=2)
    q, k, v = (t.view(2, SEQ, attn.n_head, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = attn.proj(out.transpose(1, 2).reshape(2, SEQ, 32))
    assert torch.equal(attn(x), want)
