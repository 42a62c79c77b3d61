"""A program written like the FSDP2 tutorials trains bit for bit alike, plain and ported to
gpukit, on 2 gloo processes (float64).

The plain program's habits: ``init_process_group`` from the environment, ``torch.manual_seed``
before building the model, ``fully_shard`` on each layer and then on the model, the optimizer
built after sharding, a ``DistributedSampler`` with a seed and ``set_epoch`` each epoch,
``loss.backward()``, ``clip_grad_norm_(model.parameters(), ...)``, ``optimizer.step()``,
``optimizer.zero_grad()``, and at the end the full state dict gathered to rank 0 with
``get_model_state_dict(full_state_dict=True, cpu_offload=True)``.

The port is the single-device program a user starts from: the optimizer built before
``rt.setup`` (gpukit points it at the sharded parameters), a plain shuffled DataLoader (gpukit
shards it with the run's seed), ``rt.backward``/``rt.step`` with ``Runtime(clip=...)``, and
``rt.full_state_dict()``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from tests.fakes import spawn_plain_program

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("ported-fsdp")]

VOCAB, WIDTH, DEPTH, CONTEXT = 37, 16, 3, 8
EPOCHS, BATCH, LR, CLIP = 2, 4, 3e-3, 0.5


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Layer() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as GPT-2 does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (24, CONTEXT + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _plain_worker(rank: int, port: int, folder: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = _dataset()
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    losses = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = _loss(model, x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"state": state, "losses": torch.stack(losses)}, Path(folder) / "plain.pt")
    dist.destroy_process_group()


def _gpukit_program(rt: gk.Runtime) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    model = TinyLM()  # Runtime(seed=0) seeded torch, as the plain program's manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_dataset(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    losses = []
    for _epoch in range(EPOCHS):
        for x, y in loader:
            loss = _loss(model, x, y)
            rt.backward(loss)
            rt.step(optimizer)
            losses.append(loss.detach().clone())
    state = rt.full_state_dict()
    tied = model.head.weight is model.embed.weight
    return {"state": state, "losses": torch.stack(losses), "tied": tied}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("ported-fsdp")
    spawn_plain_program(_plain_worker, str(folder), 2)
    plain = torch.load(folder / "plain.pt", weights_only=True)
    rt = gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], seed=0, clip=CLIP)
    ported = rt.launch(_gpukit_program)
    return {"plain": plain, "ported": ported}


def test_the_ported_program_trains_bit_for_bit_as_the_plain_one(results: dict[str, Any]) -> None:
    plain, ported = results["plain"], results["ported"]
    assert torch.equal(plain["losses"], ported["losses"])
    assert plain["state"].keys() == ported["state"].keys()
    unequal = [k for k, v in plain["state"].items() if not torch.equal(v, ported["state"][k])]
    assert not unequal, unequal


def test_the_ported_program_keeps_its_tie_and_trains(results: dict[str, Any]) -> None:
    ported = results["ported"]
    assert ported["tied"]
    losses = ported["losses"]
    assert len(losses) == EPOCHS * 24 // (2 * BATCH) and losses[-1] < losses[0]
