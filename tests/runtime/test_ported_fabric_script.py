"""A small real training script, written as a Lightning Fabric or Accelerate user writes it, plain
and on gpukit, logs the same values and trains the same weights under the same seed.

The script: a CNN, accumulation over 2 micro-batches, OneCycleLR stepped per optimizer step
(built from the loader's length as the script sees it, as a script written for its ranks does),
the training loss logged every few micro-batches (averaged over the ranks), validation at the
end of every epoch over a held-out set whose size does not divide by the ranks (the sampler
pads it), the best weights saved when the validation loss improves, and early stopping.

The plain program evaluates the whole validation set on every rank (its exact figure); the
gpukit port shards it and gathers with ``rt.gather_for_metrics``, which must count every sample
once. Its metrics are read back from the CSV logger's file, as a user would read them.
"""

from __future__ import annotations

import csv
import math
import os
import random
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from gpukit.checkpoint import latest
from tests.fakes import spawn_plain_program

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("ported-fabric")

SEED = 1234
EPOCHS, ACCUMULATE, BATCH, LOG_EVERY = 12, 2, 8, 3
MIN_DELTA, PATIENCE = 0.02, 1  # early stopping: epochs without an improvement of MIN_DELTA
TRAIN, VAL = 96, 37  # 37 validation samples: 2 ranks see 38, one of them twice


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3)
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(6 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)


def images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long() + (x[:, 0, 4:].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)  # learnable: the classes follow the image


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class EarlyStopping:
    def __init__(self) -> None:
        self.best, self.bad = math.inf, 0

    def improved(self, value: float) -> bool:
        better = value < self.best - MIN_DELTA
        self.best, self.bad = (value, 0) if better else (self.best, self.bad + 1)
        return better

    @property
    def stop(self) -> bool:
        return self.bad > PATIENCE


# -- plain PyTorch ------------------------------------------------------------------------------
def plain(rank: int, folder: Path) -> dict[str, Any]:
    ddp = dist.is_initialized()
    world = dist.get_world_size() if ddp else 1
    seed_everything(SEED)
    train_set, val_set = images(TRAIN, 1), images(VAL, 2)
    sampler = DistributedSampler(train_set, shuffle=True, seed=SEED) if ddp else None
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=not ddp, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=BATCH)  # the whole set, on every rank
    model: nn.Module = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if ddp:
        model = DistributedDataParallel(model)
    total_steps = EPOCHS * len(loader) // ACCUMULATE
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total_steps)
    rows: list[dict[str, float]] = []
    window: list[torch.Tensor] = []
    stopper, step, epochs_run = EarlyStopping(), 0, 0
    for epoch in range(EPOCHS):
        epochs_run += 1
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % ACCUMULATE == 0
            with model.no_sync() if ddp and not last else nullcontext():
                loss = F.nll_loss(model(x), y)
                (loss / ACCUMULATE).backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step += 1
            window.append(loss.detach())
            if len(window) == LOG_EVERY:
                mean = torch.stack(window).sum() / len(window)
                if ddp:
                    dist.all_reduce(mean)
                rows.append({"step": step, "loss": float(mean) / world})
                window = []
        model.eval()
        total, correct = torch.zeros(()), 0
        with torch.no_grad():
            for x, y in val_loader:
                out = model(x)
                total += F.nll_loss(out, y, reduction="sum")
                correct += int((out.argmax(1) == y).sum())
        val_loss = float(total) / len(val_set)
        rows.append({"step": step, "val_acc": correct / len(val_set), "val_loss": val_loss})
        if stopper.improved(val_loss) and rank == 0:
            torch.save(getattr(model, "module", model).state_dict(), folder / "plain-best.pt")
        if stopper.stop:
            break
    inner = getattr(model, "module", model)
    return {
        "weights": {k: v.clone() for k, v in inner.state_dict().items()},
        "steps": step,
        "epochs": epochs_run,
        "rows": rows,
        "lr": scheduler.get_last_lr(),
    }


# -- the same script on gpukit ------------------------------------------------------------------
def ported(rt: gk.Runtime, folder: Path) -> dict[str, Any]:
    train_set, val_set = images(TRAIN, 1), images(VAL, 2)
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=BATCH)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader, val_loader = rt.setup(model, optimizer, loader, val_loader)
    total_steps = EPOCHS * len(loader) // ACCUMULATE
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=total_steps)
    # Built from the loader as this rank sees it, as the plain script does: handed to setup (so
    # checkpoints hold it) with the Runtime's scheduler_steps="per-optimizer-step".
    model, scheduler = rt.setup(model, scheduler)
    stopper, epochs_run = EarlyStopping(), 0
    for _ in range(EPOCHS):
        epochs_run += 1
        model.train()
        for x, y in loader:
            loss = F.nll_loss(model(x), y)
            rt.backward(loss)
            if rt.step(optimizer):
                scheduler.step()
            rt.log(loss=loss)
        losses, hits = [], []
        with rt.evaluating(model):
            for x, y in val_loader:
                out = model(x)
                batch_losses, batch_hits = rt.gather_for_metrics(
                    (F.nll_loss(out, y, reduction="none"), out.argmax(1) == y)
                )
                losses.append(batch_losses)
                hits.append(batch_hits)
        losses_all, hits_all = torch.cat(losses), torch.cat(hits)
        val_loss = float(losses_all.sum()) / len(losses_all)
        rt.log_metrics(val_loss=val_loss, val_acc=float(hits_all.sum()) / len(hits_all))
        if stopper.improved(val_loss):
            rt.save(folder / "gpukit-best", keep=1)
        if stopper.stop:
            break
    return {
        "weights": {k: v.clone() for k, v in rt.unwrap(model).state_dict().items()},
        "steps": rt.global_step,
        "epochs": epochs_run,
        "lr": scheduler.get_last_lr(),
        "counted": len(losses_all),
    }


def _settings(folder: Path) -> dict[str, Any]:
    return {
        "seed": SEED,
        "accumulate": ACCUMULATE,
        "log_every": LOG_EVERY,
        "scheduler_steps": "per-optimizer-step",
        "loggers": [gk.loggers.CsvLogger(folder / "logs")],
    }


def _plain_worker(rank: int, port: int, folder: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.save(plain(rank, Path(folder)), Path(folder) / f"plain-{rank}.pt")
    finally:
        dist.destroy_process_group()


def _gpukit_worker(rt: gk.Runtime, folder: str) -> None:
    torch.save(ported(rt, Path(folder)), Path(folder) / f"gpukit-{rt.rank}.pt")


@pytest.fixture(
    scope="module",
    params=[1, pytest.param(2, marks=pytest.mark.processes)],
    ids=["1 process", "2 processes"],
)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    processes = request.param
    folder = tmp_path_factory.mktemp(f"fabric-script-{processes}")
    if processes == 1:
        want = [plain(0, folder)]
        rt = gk.Runtime(devices="cpu", **_settings(folder))
        try:
            got = [rt.launch(ported, folder)]
        finally:
            rt.teardown()
        return folder, want, got
    spawn_plain_program(_plain_worker, str(folder), 2)
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], **_settings(folder))
    rt.launch(_gpukit_worker, str(folder))
    load = lambda name: torch.load(folder / name, weights_only=False)  # noqa: E731
    return (
        folder,
        [load(f"plain-{r}.pt") for r in range(2)],
        [load(f"gpukit-{r}.pt") for r in range(2)],
    )


def test_the_port_trains_the_same_weights_and_stops_at_the_same_epoch(runs: Any) -> None:
    _, want, got = runs
    for rank, (w, g) in enumerate(zip(want, got, strict=True)):
        assert g["steps"] == w["steps"] and g["epochs"] == w["epochs"], f"rank {rank}"
        assert w["epochs"] < EPOCHS, "early stopping never stopped: the test would not check it"
        differ = [k for k in w["weights"] if not torch.equal(w["weights"][k], g["weights"][k])]
        assert not differ, f"rank {rank}: weights differ from the plain program's: {differ}"
        assert g["lr"] == w["lr"]
        assert g["counted"] == VAL  # every validation sample once, the sampler's padding left out


def test_the_logged_values_are_the_plain_programs(runs: Any) -> None:
    folder, want, _ = runs
    with open(folder / "logs" / "metrics.csv", newline="") as f:
        logged = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    expected = want[0]["rows"]
    assert [r["step"] for r in logged] == [r["step"] for r in expected]
    for got, row in zip(logged, expected, strict=True):
        assert set(got) == set(row), got
        for name, value in row.items():
            # Sums in another order (per-sample losses gathered over the ranks; float32 window
            # sums on the device): equal to float32's precision, not bit for bit.
            assert got[name] == pytest.approx(value, rel=2e-6, abs=1e-7), (name, got, row)
    accuracies = [r["val_acc"] for r in logged if "val_acc" in r]
    assert accuracies and all(abs(a * VAL - round(a * VAL)) < 1e-9 for a in accuracies)  # of 37


def test_the_best_checkpoint_holds_the_plain_programs_best_weights(runs: Any) -> None:
    folder, _, _ = runs
    best = torch.load(folder / "plain-best.pt")
    saved = load_file(str(latest(folder / "gpukit-best") / "model.safetensors"))
    assert set(saved) == set(best)
    assert all(torch.equal(saved[k], best[k]) for k in best)
