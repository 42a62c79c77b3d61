"""Selective checkpointing's policy: every second matrix product's output and attention's are
kept in each block, the rest recomputed; training under it computes what training without
checkpointing computes, bit for bit; the planner counts what the policy keeps."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint

from gpukit.planning import facts as planning_facts
from gpukit.planning import saved_tensors
from gpukit.strategies._recompute import Selection, checkpoint_blocks
from gpukit.workloads.llama import Llama, LlamaShape, llama

SHAPE = LlamaShape(dim=64, layers=2, heads=4, kv_heads=2, hidden=160, vocab=100)
aten = torch.ops.aten


def _model() -> Llama:
    torch.manual_seed(0)
    model = Llama(SHAPE, 16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    model.rope.reset_parameters()
    return model


def test_every_second_product_and_attention_are_kept() -> None:
    s = Selection()
    ops = [aten.mm.default, aten.add.Tensor, aten.mm.default, aten.addmm.default]
    ops += [aten.bmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default]
    assert [s.keeps(op) for op in ops] == [True, False, False, True, False, True]
    assert Selection().keeps(aten.mm.default)  # each block's forward counts from the first


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_training_under_checkpointing_is_bit_identical(mode: str) -> None:
    plain = _model()
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(list(checkpointed.layers), mode)
    tokens = torch.randint(SHAPE.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(SHAPE.vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for model in (plain, checkpointed):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad), name


def test_training_keeps_the_query_value_attention_and_two_feed_forward_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept: list[Any] = []
    make = torch_checkpoint.create_selective_checkpoint_contexts

    def spying(policy: Any, *args: Any, **kwargs: Any) -> Any:
        def choose(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
            decision = policy(ctx, op, *a, **k)
            if not ctx.is_recompute and decision == torch_checkpoint.CheckpointPolicy.MUST_SAVE:
                kept.append(op)
            return decision

        return make(choose, *args, **kwargs)

    monkeypatch.setattr(torch_checkpoint, "create_selective_checkpoint_contexts", spying)
    model = _model()
    checkpoint_blocks(list(model.layers), "selective")
    model(torch.zeros(1, 16, dtype=torch.long)).sum().backward()
    names = [op.__name__ for op in kept]
    # Per block: wq, (wk recomputed), wv, attention, (wo recomputed), w1, (w3 recomputed), w2.
    attention = "_scaled_dot_product_flash_attention_for_cpu.default"
    assert names == ["mm.default", "mm.default", attention, "mm.default", "mm.default"] * 2


def test_the_planner_counts_what_the_policy_keeps() -> None:
    shape = LlamaShape(dim=64, layers=3, heads=4, kv_heads=2, hidden=160, vocab=100)
    w = llama(shape, seq_len=32)
    blocks = planning_facts.recomputed_blocks(w.model)
    run = saved_tensors.fake_forward(w.model, w.dataset[0], 1, "32", w.loss, None, blocks)
    kv = shape.kv_heads * shape.dim // shape.heads
    # float32, per token: wq, wv, w1, w2 outputs, attention's output and log-sum-exp.
    per_token = 4 * (shape.dim + kv + shape.hidden + shape.dim + shape.dim + shape.heads)
    assert sum(n.nbytes for n in run.notes if n.kept) == shape.layers * 32 * per_token
    # Each block's input is held too (the embedding's output for the first).
    assert sum(n.nbytes for n in run.notes if n.block_input) == shape.layers * 32 * shape.dim * 4
