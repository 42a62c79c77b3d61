"""The FSDP2 tutorial's program (a small Transformer, ``fully_shard`` on each block then on the
root, optional mixed precision and explicit prefetch, AdamW, a few steps of ``model(x).sum()``
with gradient clipping) trains bit for bit alike, plain and under gpukit, on 2 gloo processes.

The port keeps its own ``fully_shard`` calls: gpukit keeps the groups, their mesh and their
``mp_policy`` as the user made them. Also: the same program where gpukit shards the model and
the user sets FSDP2's prefetch on gpukit's groups after ``rt.setup``; gradient accumulation
with ``accumulation="no-sync"`` (``set_requires_gradient_sync``); and a run saved halfway and
resumed in a new launch ends with the same weights.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from tests.fakes import spawn_plain_program
from tests.fsdp_models import assert_bit_identical

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("user-sharded-fsdp")]

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 64, 16, 2, 3, 8, 2
STEPS, LR, CLIP = 4, 1e-2, 1.0

# name -> (the user shards, mixed precision, explicit prefetch, micro-batches per step)
MODES: dict[str, tuple[bool, bool, bool, int]] = {
    "user-sharded": (True, False, True, 1),
    "user-sharded-mixed": (True, True, False, 1),
    "gpukit-sharded-prefetch": (False, False, True, 1),
    "user-sharded-no-sync": (True, False, False, 2),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, t, 3, HEADS, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, DIM))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.pos_embeddings = nn.Embedding(SEQ, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _shard(model: Transformer, mixed: bool) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _prefetch(model: Transformer) -> None:
    layers = list(model.layers)
    for before, after in itertools.pairwise(layers):
        before.set_modules_to_forward_prefetch([after])  # type: ignore[operator]
        after.set_modules_to_backward_prefetch([before])  # type: ignore[operator]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _plain_worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    out = {}
    for name, (_user, mixed, prefetch, micro) in MODES.items():
        torch.manual_seed(0)
        model = Transformer()
        _shard(model, mixed)
        if prefetch:
            _prefetch(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            for k in range(micro):
                model.set_requires_gradient_sync(k == micro - 1)  # type: ignore[operator]
                loss = model(_tokens()).sum()
                (loss / micro).backward()
                losses.append(loss.detach().float().clone())
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        out[name] = {"state": state, "losses": torch.stack(losses)}
    if rank == 0:
        torch.save(out, Path(folder) / "plain.pt")
    dist.destroy_process_group()


def _gpukit_program(rt: gk.Runtime, mode: str, steps: int, save: str, load: str) -> Any:
    user, mixed, prefetch, micro = MODES[mode]
    model = Transformer()  # Runtime(seed=0) seeded torch, as the plain program's manual_seed(0)
    if user:
        rt.barrier()  # fully_shard needs the process group
        _shard(model, mixed)
        if prefetch:
            _prefetch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = rt.setup(model, optimizer)
    if not user and prefetch:
        _prefetch(rt.unwrap(model))  # type: ignore[arg-type]  # gpukit's groups, as FSDPModules
    if load:
        rt.load(load)
    losses = []
    for _ in range(steps * micro):
        loss = model(_tokens()).sum()
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(loss.detach().float().clone())
    if save:
        rt.save(save)
    sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    return {"state": rt.full_state_dict(), "losses": torch.stack(losses), "sharded": sharded}


def _runtime(micro: int) -> gk.Runtime:
    strategy = gk.strategies.FSDP(accumulation="no-sync" if micro > 1 else "reduce-scatter")
    return gk.Runtime(
        strategy=strategy, devices=["cpu", "cpu"], seed=0, clip=CLIP, accumulate=micro
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("user-sharded")
    spawn_plain_program(_plain_worker, str(folder), 2)
    return torch.load(folder / "plain.pt", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_tutorial_program_trains_bit_for_bit_under_gpukit(
    plain: dict[str, Any], mode: str
) -> None:
    ported = _runtime(MODES[mode][3]).launch(_gpukit_program, mode, STEPS, "", "")
    assert ported["sharded"]
    assert torch.equal(ported["losses"], plain[mode]["losses"])
    assert_bit_identical(ported["state"], plain[mode]["state"])


def test_a_user_sharded_run_saved_halfway_resumes_to_the_same_weights(
    plain: dict[str, Any], tmp_path: Path
) -> None:
    mode, half = "user-sharded", STEPS // 2
    first = _runtime(1).launch(_gpukit_program, mode, half, str(tmp_path / "ck"), "")
    second = _runtime(1).launch(_gpukit_program, mode, STEPS - half, "", str(tmp_path / "ck"))
    losses = torch.cat([first["losses"], second["losses"]])
    assert torch.equal(losses, plain[mode]["losses"])
    assert_bit_identical(second["state"], plain[mode]["state"])
