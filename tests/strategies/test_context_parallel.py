"""Context parallel (``gk.strategies.Parallel(cp=...)``): sequences split across ranks, the
causal work balanced, attention through Ulysses's all-to-alls; checked against the plain
one-process program.

The one-process reference trains on the whole sequences in float64. A cp run computes the same
function in another order (each rank's loss is the mean over its tokens, the gradients are then
averaged over the ranks; matrix products over fewer rows), so the two agree to rounding, not
bit for bit: over 10 AdamW steps the losses and final weights differ by less than 1e-12
(``TOLERANCE``; measured at most 7e-15).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies.sequence_batches import SequenceShards
from gpukit.strategies.sequence_parallel import SequenceParallel, Ulysses
from gpukit.workloads import gpt, llama

STEPS, BATCH, LENGTH, LR = 10, 4, 16, 1e-3
TOLERANCE = 1e-12


# -- one process: the split, the positions, the refusals -------------------------------------
def test_each_rank_takes_a_cheap_and_a_dear_chunk() -> None:
    x = torch.arange(16).view(1, 16)
    parts = [SequenceShards(4, r).local(x)[0].tolist() for r in range(4)]
    assert parts == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [SequenceShards(4, r).positions(4).tolist() for r in range(4)] == parts


def test_inputs_and_targets_split_alike_and_per_sample_values_pass() -> None:
    ids, labels = torch.arange(8).view(1, 8), torch.tensor([7])
    x, y, kept = SequenceShards(2, 1).batch((ids, ids + 1, labels))
    assert x.tolist() == [[2, 3, 4, 5]] and y.tolist() == [[3, 4, 5, 6]] and kept is labels


def test_positions_are_arange_outside_a_context_parallel_forward() -> None:
    assert torch.equal(gk.sequence_positions(5), torch.arange(5))


def test_a_sequence_that_does_not_split_in_2_cp_chunks_is_refused() -> None:
    with pytest.raises(ConfigError, match="has 10 tokens, which do not split into 4") as caught:
        SequenceShards(2, 0).batch((torch.zeros(2, 10), torch.zeros(2, 10)))
    assert "divisible by 4, e.g. 8" in str(caught.value)


class _Attention(nn.Module):
    """``heads`` query heads over ``kv_heads`` key/value heads; ``mask``: an attn_mask."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, mask: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.mask = heads, kv_heads, mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = x.view(b, t, self.heads, -1).transpose(1, 2)
        kv = q[:, : self.kv_heads]
        mask = torch.ones(t, t, dtype=torch.bool).tril() if self.mask else None
        gqa = {"enable_gqa": True} if self.kv_heads != self.heads else {}
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, **gqa)


def _cp2(module: nn.Module) -> nn.Module:
    # No group: each refusal comes before any collective would need one.
    shards = SequenceShards(2, 0)
    SequenceParallel(module, shards, Ulysses(shards, group=None))
    return module


@pytest.mark.parametrize(
    ("model", "said"),
    [
        (_Attention(heads=3, kv_heads=3), "query has 3 heads, which do not split across 2"),
        (_Attention(heads=4, kv_heads=1), "key/value has 1 heads, which do not split across 2"),
        (_Attention(mask=True), "was given an attn_mask"),
        (nn.Linear(12, 12), "called no torch.nn.functional.scaled_dot_product_attention"),
    ],
)
def test_an_attention_cp_cannot_split_is_refused_before_any_collective(
    model: nn.Module, said: str
) -> None:
    with pytest.raises(ConfigError, match="context parallel cp=2") as caught:
        _cp2(model)(torch.zeros(1, 4, 12))
    assert said in str(caught.value)
    assert gk.sequence_positions(2).tolist() == [0, 1]  # the forward's state left behind it


@pytest.mark.parametrize(("cut", "said"), [({4}, "(4)"), (set(), "(none yet)")])
def test_a_forward_on_sequences_not_cut_is_refused(cut: set[int], said: str) -> None:
    shards = SequenceShards(2, 0)
    model = _Attention()
    SequenceParallel(model, shards, Ulysses(shards, group=None), cut)
    with pytest.raises(ConfigError, match="called with a sequence of 8 tokens") as caught:
        model(torch.zeros(1, 8, 12))  # e.g. a batch shifted after the cut, or never cut
    assert said in str(caught.value)
    assert gk.sequence_positions(2).tolist() == [0, 1]


def test_under_whole_sequences_a_forward_is_the_plain_one() -> None:
    shards = SequenceShards(2, 1)
    model = _Attention()
    SequenceParallel(model, shards, Ulysses(shards, group=None), cut={4})
    x = torch.randn(1, 8, 12)
    with gk.whole_sequences():  # no group is needed: nothing is exchanged
        assert torch.equal(model(x), _Attention()(x))
        assert gk.sequence_positions(3).tolist() == [0, 1, 2]


def test_the_strategy_shows_its_context_ranks_and_attention() -> None:
    rt = gk.Runtime(strategy=gk.strategies.Parallel(cp=2), devices=["cpu"] * 2)
    assert "layout=cp 2, cp_attention=ulysses" in repr(rt.strategy)


def test_settings_context_parallel_cannot_run_are_refused_before_any_process() -> None:
    with pytest.raises(ConfigError, match="cp_attention='flash'"):
        gk.strategies.Parallel(cp=2, cp_attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ring attention runs only CUDA"):
        gk.Runtime(strategy=gk.strategies.Parallel(cp=2, cp_attention="ring"), devices=["cpu"] * 2)
    with pytest.raises(ConfigError, match="compile"):
        gk.Runtime(strategy=gk.strategies.Parallel(cp=2), devices=["cpu"] * 2, compile=True)


# -- processes: the same training as one process -------------------------------------------
def _workload(name: str) -> tuple[nn.Module, Any, Any]:
    """(float64 model, dataset of (tokens, next tokens), loss) of a tiny ``name``."""
    if name == "gpt":
        config = gpt.GPTConfig(vocab_size=128, context=LENGTH, n_layer=2, n_head=4, d_model=32)
        w = gpt.build(seed=0, config=config)
        model = w.model
    else:  # llama: grouped-query attention (4 query, 2 key/value heads), rotary positions
        sizes = {"layers": 2, "dim": 32, "heads": 4, "kv_heads": 2, "hidden": 64, "vocab": 97}
        w = llama.llama3_2_1b(seq_len=LENGTH, sizes=sizes)
        model = w.model.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    # Cross entropy in float64 for both (llama's own loss rounds the logits to float32).
    return model.double(), Subset(w.dataset, range(STEPS * BATCH)), gpt.SequenceCrossEntropy()


def _llama_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    columns, rows = ColwiseParallel(), RowwiseParallel()
    plan = {f"layers.*.attention.{n}": columns for n in ("wq", "wk", "wv")}
    return plan | {
        "layers.*.attention.wo": rows,
        "layers.*.w1": columns,
        "layers.*.w3": columns,
        "layers.*.w2": rows,
    }


def _train(rt: gk.Runtime, name: str) -> dict[str, Any]:
    model, dataset, loss_fn = _workload(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per_rank = BATCH // rt.strategy.sampler_placement()[0]  # the data ranks share each batch
    model, optimizer, loader = rt.setup(model, optimizer, DataLoader(dataset, batch_size=per_rank))
    losses, exchanges = [], []
    with mock.patch.object(dist, "all_to_all_single", wraps=dist.all_to_all_single) as counted:
        for x, y in loader:
            before = counted.call_count
            loss = loss_fn(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            exchanges.append(counted.call_count - before)
            losses.append(rt.all_reduce(loss.detach(), "mean"))
    state = rt.unwrap(model).state_dict()
    weights = {k: v.full_tensor().detach().clone() for k, v in state.items()}
    # This rank's chunks of its samples, made whole sequences again and joined over the ranks.
    last = rt.gather_for_metrics(x)
    return {"losses": torch.stack(losses), "weights": weights, "exchanges": exchanges, "last": last}


def _reference(name: str) -> dict[str, Any]:
    model, dataset, loss_fn = _workload(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in DataLoader(dataset, batch_size=BATCH):
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": torch.stack(losses), "weights": state, "last": x}


def _assert_same_training(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert len(got["losses"]) == STEPS
    assert torch.equal(got["last"], want["last"])  # gather_for_metrics: whole sequences
    worst = (got["losses"] - want["losses"]).abs().max().item()
    assert worst < TOLERANCE, f"losses differ by up to {worst}"
    assert got["weights"].keys() == want["weights"].keys()
    for k, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], w, rtol=0, atol=TOLERANCE, msg=k)


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize(
    ("name", "checkpointing"),
    [("gpt", "off"), ("llama", "off"), ("gpt", "full"), ("llama", "selective")],
)
def test_two_context_parallel_ranks_train_as_one_process(name: str, checkpointing: str) -> None:
    strategy = gk.strategies.Parallel(cp=2, activation_checkpointing=checkpointing)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 2, seed=0)
    got = rt.launch(_train, name)
    _assert_same_training(got, _reference(name))
    # One all-to-all into each attention (queries, keys and values together), one out, and
    # the same two in the backward: 4 per layer and step, 2 layers; a block recomputed in
    # the backward makes its forward's two again.
    assert got["exchanges"] == [8 if checkpointing == "off" else 12] * STEPS


def _attention(rt: gk.Runtime) -> list[float]:
    """Ulysses's attention of this rank's chunks against torch's over whole sequences
    (outputs and input gradients), causal or not, with as many key/value heads as query
    heads or half as many: the worst difference of each."""
    shards = rt.strategy.sequence_shards  # type: ignore[attr-defined]
    ulysses = Ulysses(shards, rt.strategy.mesh["cp"].get_group())  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(0)
    worst = []
    for kv_heads, causal in ((4, True), (2, True), (2, False)):
        q = torch.randn(2, 4, LENGTH, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(2, kv_heads, LENGTH, 8, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(2)
        )
        options = {"is_causal": causal, "enable_gqa": kv_heads != 4}
        whole = F.scaled_dot_product_attention(q, k, v, **options)
        local = [shards.local(t.detach(), dim=2).requires_grad_() for t in (q, k, v)]
        got = ulysses(F.scaled_dot_product_attention, *local, **options)
        worst.append((got - shards.local(whole, dim=2)).abs().max().item())
        # Every rank's backward runs together (the all-to-alls'): each gets the gradient of
        # the sum over all ranks' outputs with respect to its own tokens.
        wanted = torch.autograd.grad(whole.sum(), (q, k, v))
        for mine, full in zip(torch.autograd.grad(got.sum(), local), wanted, strict=True):
            worst.append((mine - shards.local(full, dim=2)).abs().max().item())
    return worst


@pytest.mark.slow
@pytest.mark.processes
def test_ulysses_attention_equals_attention_over_whole_sequences() -> None:
    rt = gk.Runtime(strategy=gk.strategies.Parallel(cp=2), devices=["cpu"] * 2)
    assert max(rt.launch(_attention)) < 1e-13


@pytest.mark.slow
@pytest.mark.processes
def test_context_times_shards_train_as_one_process() -> None:
    rt = gk.Runtime(strategy=gk.strategies.Parallel(dp_shard=2, cp=2), devices=["cpu"] * 4)
    _assert_same_training(rt.launch(_train, "gpt"), _reference("gpt"))


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize(("name", "hand_plan"), [("llama", True), ("gpt", False)])
def test_context_times_tensor_parallel_train_as_one_process(name: str, hand_plan: bool) -> None:
    # llama by a plan given by hand; gpt by the plan gpukit reads off it.
    plan = _llama_plan() if hand_plan else None
    strategy = gk.strategies.Parallel(tp=2, cp=2, tp_plan=plan)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4)
    _assert_same_training(rt.launch(_train, name), _reference(name))


def _gpukit_train(out: Path, *argv: str) -> dict[str, Any]:
    """One step of ``gpukit train --workload gpt`` (a learning rate too small to move the
    weights: the validation after it sees the initial model); its first loss and metrics."""
    flags = ["--max-steps", "1", "--lr", "1e-12", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", "--workload", "gpt", *argv, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    metrics = json.loads((out / "metrics.json").read_text())
    return {"loss": float(next(r["loss"] for r in rows if r["loss"])), **metrics}


@pytest.mark.slow
@pytest.mark.processes
def test_gpukit_train_with_cp_takes_the_global_batch_of_one_device(tmp_path: Path) -> None:
    one = _gpukit_train(tmp_path / "one", "--devices", "cpu")
    cp = _gpukit_train(tmp_path / "cp", "--devices", "cpu,cpu", "--cp", "2")
    # The cp ranks read the same samples: the global batch stays the workload's, not half.
    assert cp["global_batch"] == one["global_batch"]
    assert cp["loss"] == pytest.approx(one["loss"], rel=1e-6)  # float32, summed otherwise
    assert cp["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-6)
    assert len(cp["sample"]) == 200  # written on whole sequences (gk.whole_sequences)
