"""Programs written for Accelerate and for Lightning Fabric, run there and as ported to gpukit,
train the same weights bit for bit on 1 and on 2 ranks.

The program: an MLP with dropout (so the global random stream matters), AdamW, a
``shuffle=True`` loader whose batch size does not divide the dataset (45 samples, batches of
4: a short last batch, and on 2 ranks a last round that is padded), 2 epochs.

The Accelerate anchor (``Accelerator(cpu=True)``) and its port with
``gk.Runtime(seed=SEED, data_order="accelerate")``. The port's edits: ``Accelerator(cpu=True)``
and ``set_seed(SEED)`` become ``gk.Runtime(seed=SEED, data_order="accelerate")``;
``accelerator.prepare`` becomes ``rt.setup``; ``accelerator.backward(loss)`` becomes
``rt.backward(loss)``; ``optimizer.step(); optimizer.zero_grad()`` becomes
``rt.step(optimizer)``; ``accelerator.unwrap_model`` becomes ``rt.unwrap``. The same port with
the default ``data_order="torch"`` trains other weights on 2 ranks (a ``DistributedSampler``
seeded with the run's seed, not a generator drawn from the global one, and shares of samples,
not whole batches): the reason the option exists. The port also resumes: stopped and saved
mid-way through the second epoch, then started again from that checkpoint, it ends with the
same weights. And a variant of both seeds each rank apart before setting the loader up (each
rank then draws another sampler seed): Accelerate's per-pass sync of rank 0's generator, which
gpukit makes too, gives every rank rank 0's order, so these match as well. Another cuts every
batch into a piece per rank (``split_batches=True``, ``DataLoaderConfiguration`` there, a
``gk.Runtime`` keyword here) and steps a ``OneCycleLR`` built from ``len(loader)`` after every
optimizer step: the global batch is then the loader's own, so its scheduler steps once a call
on any number of ranks; the weights and the last learning rate match.

The Fabric anchor (``Fabric(accelerator="cpu", devices=N, strategy="ddp")``,
``seed_everything``, ``fabric.setup``, ``fabric.setup_dataloaders``, ``fabric.backward``) and its
port with the default order. The port's edits: ``Fabric(...)``, ``fabric.launch()`` and
``seed_everything(SEED)`` become ``gk.Runtime(seed=SEED)`` (Fabric's ``DistributedSampler``
takes its seed from ``PL_GLOBAL_SEED``, which ``seed_everything`` sets: gpukit's takes the run's
seed, so the same seed gives the same order); ``fabric.setup`` and
``fabric.setup_dataloaders`` become one ``rt.setup``; ``fabric.backward(loss)`` becomes
``rt.backward(loss)``; ``optimizer.step(); optimizer.zero_grad()`` becomes
``rt.step(optimizer)``. On 1 device Fabric's ddp strategy still swaps the loader's sampler for
a ``DistributedSampler(num_replicas=1, seed=PL_GLOBAL_SEED)``, whose order is not the
``RandomSampler``'s that gpukit keeps in one process: there the port names that sampler itself
(``sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=SEED)``; gpukit keeps it and
calls its ``set_epoch`` every pass, as Fabric does). On 2 ranks no edit is needed.

Each rank count runs once, in one set of processes (``tests.fakes.spawn_plain_program``), every
program back to back: the process group the first one makes serves the others.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from tests.fakes import spawn_plain_program

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("anchor-programs")]

SEED, SAMPLES, BATCH, EPOCHS = 1234, 45, 4, 2
Weights = dict[str, torch.Tensor]


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
    )


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _copy(module: nn.Module) -> Weights:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# -- Accelerate, and its port -------------------------------------------------------------------
def _reseed_by_rank(rank: int | None) -> None:
    # A program that seeds each rank its own way before setting its loader up: each rank
    # draws another sampler seed, and only the per-pass sync makes the ranks agree.
    if rank is not None:
        torch.manual_seed(SEED + 1 + rank)


def accelerate_program(rank: int | None = None) -> Weights:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    _reseed_by_rank(rank)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return _copy(accelerator.unwrap_model(model))


def _one_cycle(optimizer: torch.optim.Optimizer, batches: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.05, total_steps=EPOCHS * batches)


def accelerate_split_program() -> Weights:
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    config = DataLoaderConfiguration(split_batches=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    set_seed(SEED)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    scheduler = _one_cycle(optimizer, len(loader))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    lr = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    return {**_copy(accelerator.unwrap_model(model)), "lr": lr}


def gpukit_split_port() -> Weights:
    rt = gk.Runtime(seed=SEED, data_order="accelerate", split_batches=True)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    scheduler = _one_cycle(optimizer, len(loader))
    model, optimizer, loader, scheduler = rt.setup(model, optimizer, loader, scheduler)
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            rt.step(optimizer)
            scheduler.step()
    lr = torch.tensor(scheduler.get_last_lr(), dtype=torch.float64)
    weights = {**_copy(rt.unwrap(model)), "lr": lr}
    rt.teardown()
    return weights


def gpukit_port(data_order: Any, rank: int | None = None) -> Weights:
    rt = gk.Runtime(seed=SEED, data_order=data_order)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    _reseed_by_rank(rank)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
    weights = _copy(rt.unwrap(model))
    rt.teardown()
    return weights


def gpukit_port_resumed(folder: Path, stop_at: int) -> Weights | None:
    """The port stopped after ``stop_at`` steps (mid-epoch) and saved; then started again, it
    loads that checkpoint and goes on from the next batch."""
    rt = gk.Runtime(seed=SEED, data_order="accelerate")
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    first = rt.load(folder)["epoch"] if not stop_at else 0
    for _ in range(first, EPOCHS):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            if rt.global_step == stop_at:
                rt.save(folder)
                rt.teardown()
                return None
    weights = _copy(rt.unwrap(model))
    rt.teardown()
    return weights


# -- Lightning Fabric, and its port --------------------------------------------------------------
def fabric_program(world: int) -> Weights:
    from lightning.fabric import Fabric, seed_everything

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    seed_everything(SEED, verbose=False)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=BATCH, shuffle=True))
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return _copy(model.module if hasattr(model, "module") else model)


def fabric_port(world: int) -> Weights:
    rt = gk.Runtime(seed=SEED)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = _data()
    if world == 1:  # what Fabric's ddp strategy gives one device (see the module docstring)
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=SEED)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    else:
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    for _ in range(EPOCHS):
        model.train()
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
    weights = _copy(rt.unwrap(model))
    rt.teardown()
    return weights


def _worker(rank: int, port: int, folder: str, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:  # as torchrun starts each rank
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
        )
    results = {
        "accelerate": accelerate_program(),
        "gpukit-accelerate": gpukit_port("accelerate"),
        "gpukit-torch": gpukit_port("torch"),
        "accelerate-reseeded": accelerate_program(rank),
        "gpukit-reseeded": gpukit_port("accelerate", rank),
        "accelerate-split": accelerate_split_program(),
        "gpukit-split": gpukit_split_port(),
        # Stopped in the second epoch, then resumed (epoch 1 starts at step 12 on 1 rank, 6 on 2).
        "gpukit-resumed": gpukit_port_resumed(Path(folder, "ckpt"), 12 // world + 2)
        or gpukit_port_resumed(Path(folder, "ckpt"), 0),
        "fabric": fabric_program(world),
        "gpukit-fabric": fabric_port(world),
    }
    torch.save(results, Path(folder, f"rank{rank}.pt"))


def _run(folder: Path, world: int) -> list[dict[str, Weights]]:
    spawn_plain_program(_Ranks(world), str(folder), world)
    return [torch.load(folder / f"rank{r}.pt") for r in range(world)]


class _Ranks:
    """``_worker`` for ``world`` ranks, as spawn_plain_program calls it (picklable)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __call__(self, rank: int, port: int, folder: str) -> None:
        _worker(rank, port, folder, self.world)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    return world, _run(tmp_path_factory.mktemp(f"anchors-{world}"), world)


def _equal(a: Weights, b: Weights) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_accelerate_program_ported_with_its_order_trains_the_same_weights(runs: Any) -> None:
    _, ranks = runs
    for results in ranks:
        assert _equal(results["accelerate"], results["gpukit-accelerate"])


def test_ranks_seeded_apart_get_rank_0s_data_order_as_under_accelerate(runs: Any) -> None:
    _, ranks = runs
    for results in ranks:
        assert _equal(results["accelerate-reseeded"], results["gpukit-reseeded"])


def test_split_batches_train_the_same_weights_and_step_the_scheduler_once_a_call(
    runs: Any,
) -> None:
    _, ranks = runs
    for results in ranks:
        assert _equal(results["accelerate-split"], results["gpukit-split"])


def test_a_run_resumed_mid_epoch_in_accelerates_order_trains_the_same_weights(runs: Any) -> None:
    _, ranks = runs
    for results in ranks:
        assert _equal(results["accelerate"], results["gpukit-resumed"])


def test_the_default_order_differs_from_accelerate_on_two_ranks_only(runs: Any) -> None:
    world, ranks = runs
    for results in ranks:
        same = _equal(results["accelerate"], results["gpukit-torch"])
        assert same == (world == 1)


def test_fabric_program_ported_with_the_default_order_trains_the_same_weights(runs: Any) -> None:
    world, ranks = runs
    for results in ranks:
        assert _equal(results["fabric"], results["gpukit-fabric"])
        # The same port with shuffle=True: equal on 2 ranks, not on one (Fabric's sampler).
        assert _equal(results["fabric"], results["gpukit-torch"]) == (world > 1)
