"""Three programs written in the habits of well-known public ones, plain and ported to gpukit,
train exactly alike under the same seed, in 1 process and in 2 gloo processes.

- ``tutorial``: the PyTorch DDP tutorial's ``Trainer`` (a peek at the batch size every epoch,
  the user's own ``DistributedSampler`` and its ``set_epoch``, ``.to(device)``, a rank-0-only
  ``torch.save`` of the weights every epoch, dropout).
- ``nanogpt``: nanoGPT's loop (no DataLoader: ``torch.randint`` offsets into a ``np.memmap``,
  per-rank seeds, the next batch drawn right after the forward, ``loss / accumulation``,
  ``require_backward_grad_sync``, gradient clipping, AdamW, a ``break`` at ``max_iters``).
- ``fabric``: a Lightning Fabric image-classifier example (``seed_everything``, a download under
  ``main_process_first``, ``len(loader.dataset)``, ``all_reduce`` of a Python int and of a tensor
  for the test accuracy, ``StepLR``, dropout).

Each port changes only what gpukit replaces: the Runtime for the process group, ``rt.setup``,
``rt.backward``/``rt.step`` for the backward and the step, ``rt.device`` for the device.
Compared bit for bit: every weight on every rank, the number of optimizer steps, the torch
random state at the end, and each program's own outputs.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from tests.fakes import spawn_plain_program

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("ported-programs")

SEED = 4321
PROGRAMS = ("tutorial", "nanogpt", "fabric")


def _snapshot(model: nn.Module, steps: int, **extra: Any) -> dict[str, Any]:
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "steps": steps,
        "rng": torch.get_rng_state(),
        **extra,
    }


# -- the DDP tutorial's Trainer ----------------------------------------------------------------
def _tutorial_data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(90, 20, generator=g), torch.randint(0, 4, (90,), generator=g))


def _tutorial_model() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))


class _PlainTrainer:
    def __init__(self, model: nn.Module, data: DataLoader, rank: int, folder: Path) -> None:
        self.rank, self.folder = rank, folder
        self.model = DistributedDataParallel(model) if dist.is_initialized() else model
        self.train_data = data
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.steps, self.batch_sizes = 0, []

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        self.steps += 1

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])  # the tutorial's peek, every epoch
        self.batch_sizes.append(b_sz)
        if isinstance(self.train_data.sampler, DistributedSampler):
            self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to("cpu"), targets.to("cpu"))

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0:
                inner = getattr(self.model, "module", self.model)
                torch.save(inner.state_dict(), self.folder / f"ckpt-plain-{epoch}.pt")


class _PortedTrainer:
    """The same Trainer on gpukit: the process group, the wrapping and the step are rt's."""

    def __init__(self, rt: gk.Runtime, model: nn.Module, data: DataLoader, folder: Path) -> None:
        self.rt, self.folder = rt, folder
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        self.model, self.optimizer, self.train_data = rt.setup(model, optimizer, data)
        self.steps, self.batch_sizes = 0, []

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        loss = F.cross_entropy(self.model(source), targets)
        self.rt.backward(loss)
        self.steps += int(self.rt.step(self.optimizer))

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        self.batch_sizes.append(b_sz)
        if isinstance(self.train_data.sampler, DistributedSampler):
            self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source.to(self.rt.device), targets.to(self.rt.device))

    def train(self, max_epochs: int) -> None:
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.rt.rank == 0:  # plain torch.save on rank 0: not a collective
                weights = self.rt.unwrap(self.model).state_dict()
                torch.save(weights, self.folder / f"ckpt-gpukit-{epoch}.pt")


def _tutorial_loader(distributed: bool) -> DataLoader:
    data = _tutorial_data()
    if distributed:  # multigpu.py: the user's own sampler, shuffle left to it
        return DataLoader(data, batch_size=8, shuffle=False, sampler=DistributedSampler(data))
    return DataLoader(data, batch_size=8, shuffle=True)  # singlegpu.py


def _plain_tutorial(rank: int, folder: Path) -> dict[str, Any]:
    torch.manual_seed(SEED)
    trainer = _PlainTrainer(
        _tutorial_model(), _tutorial_loader(dist.is_initialized()), rank, folder
    )
    trainer.train(3)
    inner = getattr(trainer.model, "module", trainer.model)
    return _snapshot(inner, trainer.steps, batch_sizes=trainer.batch_sizes)


def _gpukit_tutorial(rt: gk.Runtime, folder: Path) -> dict[str, Any]:
    torch.manual_seed(SEED)
    # Built before rt.setup, as the tutorial builds it before its Trainer.
    loader = _tutorial_loader(rt.world_size > 1)
    trainer = _PortedTrainer(rt, _tutorial_model(), loader, folder)
    trainer.train(3)
    return _snapshot(rt.unwrap(trainer.model), trainer.steps, batch_sizes=trainer.batch_sizes)


# -- nanoGPT's loop ----------------------------------------------------------------------------
VOCAB, BLOCK, BATCH, ACCUMULATE, MAX_ITERS, CLIP = 50, 12, 4, 2, 6, 1.0


class _TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 24)
        self.wpe = nn.Embedding(BLOCK, 24)
        self.drop = nn.Dropout(0.1)
        self.mlp = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
        self.lm_head = nn.Linear(24, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        x = x + self.mlp(x)
        logits = self.lm_head(x)
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def _token_file(folder: Path) -> Path:
    path = folder / "train.bin"
    if not path.exists():
        tokens = np.random.default_rng(3).integers(0, VOCAB, 2000).astype(np.uint16)
        tokens.tofile(path)
    return path


def _get_batch(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(path, dtype=np.uint16, mode="r")  # reopened every batch, as nanoGPT does
    ix = torch.randint(len(data) - BLOCK, (BATCH,))
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix])
    return x, y


def _plain_nanogpt(rank: int, folder: Path) -> dict[str, Any]:
    ddp = dist.is_initialized()
    torch.manual_seed(1337 + rank)  # seed_offset = rank
    path = _token_file(folder) if rank == 0 else folder / "train.bin"
    if ddp:
        dist.barrier()
    model: nn.Module = _TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if ddp:
        model = DistributedDataParallel(model)
    X, Y = _get_batch(path)
    iter_num, losses = 0, []
    while True:
        for micro_step in range(ACCUMULATE):
            if ddp:
                model.require_backward_grad_sync = micro_step == ACCUMULATE - 1
            loss = model(X, Y) / ACCUMULATE
            X, Y = _get_batch(path)  # the next batch, while the device would be busy
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * ACCUMULATE)
        iter_num += 1
        if iter_num >= MAX_ITERS:
            break
    inner = getattr(model, "module", model)
    return _snapshot(inner, iter_num, losses=losses)


def _gpukit_nanogpt(rt: gk.Runtime, folder: Path) -> dict[str, Any]:
    torch.manual_seed(1337 + rt.rank)  # the program's own per-rank seed, kept
    with rt.main_process_first():
        path = _token_file(folder)
    model = _TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = rt.setup(model, optimizer)
    X, Y = _get_batch(path)
    iter_num = 0
    while True:
        for _ in range(ACCUMULATE):
            loss = model(X, Y)
            X, Y = _get_batch(path)
            rt.backward(loss)  # divides by accumulate; syncs only on the last micro-step
        rt.step(optimizer)  # clips (Runtime(clip=...)), steps, zeroes
        rt.log(loss=loss)
        iter_num += 1
        if iter_num >= MAX_ITERS:
            break
    # No loader pass ends here to close the last logging window: read it back now, on every
    # rank (the window also closes by itself when a function run by rt.launch returns).
    logged = rt.flush_logs()
    return _snapshot(rt.unwrap(model), rt.global_step, logged=logged["loss"])


# -- a Fabric image-classifier example ---------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        x = self.dropout(torch.flatten(x, 1))
        return F.log_softmax(self.fc(x), dim=1)


def _images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _plain_fabric(rank: int, folder: Path) -> dict[str, Any]:
    ddp = dist.is_initialized()
    _seed_everything(SEED)
    train_set, test_set = _images(64, 1), _images(32, 2)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=SEED) if ddp else None
    test_sampler = DistributedSampler(test_set, shuffle=False, seed=SEED) if ddp else None
    train_loader = DataLoader(train_set, batch_size=8, shuffle=not ddp, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=8, sampler=test_sampler)
    model: nn.Module = _Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    if ddp:
        model = DistributedDataParallel(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    steps, accuracy = 0, []
    for epoch in range(2):
        if ddp:
            train_sampler.set_epoch(epoch)  # type: ignore[union-attr]
            test_sampler.set_epoch(epoch)  # type: ignore[union-attr]
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
            steps += 1
        scheduler.step()
        model.eval()
        correct, test_loss = 0, torch.zeros(())
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum")
                correct += int((output.argmax(dim=1) == target).sum())
        if ddp:
            total = torch.tensor(correct)
            dist.all_reduce(total)
            dist.all_reduce(test_loss)
            correct = int(total)
        accuracy.append((correct, len(test_loader.dataset), float(test_loss)))
    inner = getattr(model, "module", model)
    return _snapshot(inner, steps, accuracy=accuracy)


def _gpukit_fabric(rt: gk.Runtime, folder: Path) -> dict[str, Any]:
    with rt.main_process_first():  # "download" once
        train_set, test_set = _images(64, 1), _images(32, 2)
    train_loader = DataLoader(train_set, batch_size=8, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=8)
    model = _Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer, train_loader, test_loader = rt.setup(
        model, optimizer, train_loader, test_loader
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    accuracy = []
    for _ in range(2):
        model.train()
        for data, target in train_loader:
            rt.backward(F.nll_loss(model(data), target))
            rt.step(optimizer)
        scheduler.step()
        model.eval()
        correct, test_loss = 0, torch.zeros((), device=rt.device)
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum")
                correct += int((output.argmax(dim=1) == target).sum())
        correct = rt.all_reduce(correct, "sum")  # a Python int
        test_loss = rt.all_reduce(test_loss, "sum")  # a tensor
        rt.print(f"accuracy {correct}/{len(test_loader.dataset)}")
        accuracy.append((correct, len(test_loader.dataset), float(test_loss)))
    return _snapshot(rt.unwrap(model), rt.global_step, accuracy=accuracy)


PLAIN = {"tutorial": _plain_tutorial, "nanogpt": _plain_nanogpt, "fabric": _plain_fabric}
# The Runtime each port makes: what the program asked of its process group and its step.
SETTINGS: dict[str, dict[str, Any]] = {
    "tutorial": {},
    "nanogpt": {"accumulate": ACCUMULATE, "clip": CLIP},
    "fabric": {"seed": SEED},  # Fabric's seed_everything
}


def _gpukit_program(rt: gk.Runtime, name: str, folder: Path) -> dict[str, Any]:
    run = {"tutorial": _gpukit_tutorial, "nanogpt": _gpukit_nanogpt, "fabric": _gpukit_fabric}
    return run[name](rt, folder)


# -- running them ------------------------------------------------------------------------------


def _plain_worker(rank: int, port: int, folder: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name in PROGRAMS:
            result = PLAIN[name](rank, Path(folder))
            torch.save(result, Path(folder) / f"plain-{name}-{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _gpukit_worker(rt: gk.Runtime, folder: str) -> None:
    for name in PROGRAMS:
        # Each program makes its own Runtime, as a script under `gpukit launch` would; they
        # join the process group the launched one holds.
        own = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], **SETTINGS[name])
        try:
            result = _gpukit_program(own, name, Path(folder))
        finally:
            own.teardown()
        torch.save(result, Path(folder) / f"gpukit-{name}-{rt.rank}.pt")


Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(
    scope="module",
    params=[1, pytest.param(2, marks=pytest.mark.processes)],
    ids=["1 process", "2 processes"],
)
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    processes = request.param
    folder = tmp_path_factory.mktemp(f"ported-{processes}")
    out: Results = {}
    if processes == 1:
        for name in PROGRAMS:
            out[f"plain-{name}"] = [PLAIN[name](0, folder)]
            rt = gk.Runtime(devices="cpu", **SETTINGS[name])
            out[f"gpukit-{name}"] = [_gpukit_program(rt, name, folder)]
        return out
    spawn_plain_program(_plain_worker, str(folder), 2)
    gk.Runtime(strategy="ddp", devices=["cpu", "cpu"]).launch(_gpukit_worker, str(folder))
    for side in ("plain", "gpukit"):
        for name in PROGRAMS:
            out[f"{side}-{name}"] = [
                torch.load(folder / f"{side}-{name}-{r}.pt", weights_only=False) for r in range(2)
            ]
    out["folder"] = [{"path": folder}]
    return out


def _assert_same(results: Results, name: str) -> None:
    plain, ported = results[f"plain-{name}"], results[f"gpukit-{name}"]
    assert len(plain) == len(ported)
    for rank, (want, got) in enumerate(zip(plain, ported, strict=True)):
        assert got["steps"] == want["steps"], f"{name} rank {rank}: steps"
        differ = [
            f"{key} (max abs diff {(w.double() - got['weights'][key].double()).abs().max():.3g})"
            for key, w in want["weights"].items()
            if not torch.equal(w, got["weights"][key])
        ]
        assert not differ, f"{name} rank {rank}: weights differ from the plain program: {differ}"
        assert torch.equal(got["rng"], want["rng"]), f"{name} rank {rank}: random stream moved"


def test_the_ddp_tutorial_trainer(results: Results) -> None:
    _assert_same(results, "tutorial")
    for plain, ported in zip(results["plain-tutorial"], results["gpukit-tutorial"], strict=True):
        assert ported["batch_sizes"] == plain["batch_sizes"] == [8, 8, 8]
        assert ported["steps"] == 3 * (12 if len(results["plain-tutorial"]) == 1 else 6)
    if "folder" in results:  # the rank-0 checkpoints hold the same weights
        folder = results["folder"][0]["path"]
        for epoch in range(3):
            plain = torch.load(folder / f"ckpt-plain-{epoch}.pt")
            ported = torch.load(folder / f"ckpt-gpukit-{epoch}.pt")
            assert all(torch.equal(plain[k], ported[k]) for k in plain)


def test_the_nanogpt_loop(results: Results) -> None:
    _assert_same(results, "nanogpt")
    plain, ported = results["plain-nanogpt"], results["gpukit-nanogpt"]
    assert all(r["steps"] == MAX_ITERS for r in ported)
    # nanoGPT reads each step's loss on its own rank; rt.log averages them over the steps and
    # the ranks, in one read
    mean = sum(sum(r["losses"]) / MAX_ITERS for r in plain) / len(plain)
    assert all(r["logged"] == pytest.approx(mean, rel=1e-5) for r in ported)


def test_the_fabric_example(results: Results) -> None:
    _assert_same(results, "fabric")
    for plain, ported in zip(results["plain-fabric"], results["gpukit-fabric"], strict=True):
        assert [a[:2] for a in ported["accuracy"]] == [a[:2] for a in plain["accuracy"]]
        for (_, _, want), (_, _, got) in zip(plain["accuracy"], ported["accuracy"], strict=True):
            assert got == pytest.approx(want, rel=1e-6)
