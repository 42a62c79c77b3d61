"""A program written like the PyTorch DDP tutorial, ported to gpukit, computes the same thing.

The plain program (``torch.multiprocessing.spawn``, ``init_process_group("gloo")`` on
127.0.0.1, a ``DistributedSampler`` with shuffle and a seed, ``sampler.set_epoch``, a
DDP-wrapped model, ``model.no_sync()`` and ``loss / accumulate`` to accumulate) and its port to
gpukit (``gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], seed=...)``, ``rt.setup``,
``rt.backward``/``rt.step`` or ``rt.train_step`` and ``rt.log``, started by ``rt.launch``) run
under the same seed, 2 processes each. Their final weights and buffers, and the torch random
stream, must be equal bit for bit (``torch.equal``) on both ranks.

What makes the two equal, by construction of each side:
- data order: gpukit gives each loader a ``DistributedSampler(shuffle, seed=rt.seed)`` and calls
  ``set_epoch(epoch)`` at each pass, which is what the tutorial does by hand with the same seed;
- initial weights: ``Runtime(seed=...)`` seeds torch in each process; the plain program calls
  ``torch.manual_seed`` with that seed before building the model (and DDP broadcasts rank 0's);
- dropout: both draw from the global torch generator, seeded alike on both sides, so the masks
  match only if nothing else draws from it differently. A ``DataLoader`` without a
  ``generator`` draws one int64 from it each time an epoch's iterator starts (the workers' base
  seed, drawn even with ``num_workers=0``), and gpukit's loader makes that same draw; the
  variants "..._generator" give the loader a seeded generator, as PyTorch's reproducibility
  notes advise, so that draw leaves it alone;
- accumulation: gpukit divides by ``accumulate`` and skips DDP's all-reduce on the non-final
  micro-batches, as ``model.no_sync()`` and ``loss / accumulate`` do.

Every variant runs in one plain spawn and one ``rt.launch`` (each costs seconds here): the
launched function trains variant "sgd" on the Runtime ``rt.launch`` made, and builds one more
Runtime per other variant, as a script started by ``gpukit launch`` would (they join the process
group the first one holds).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from tests.fakes import spawn_plain_program

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("ddp-fidelity")]

SEED = 1234  # not 0: a seed that did not reach the sampler or the model would show
WORLD = 2
DEVICES = ["cpu"] * WORLD
SAMPLES = 95  # not a multiple of the ranks: the sampler pads a shard, alike on both sides
EPOCHS = 3
LOG_EVERY = 4  # 6 steps per epoch: a window of 4, and one of 2 at the epoch's end


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
    )


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _bn_dropout() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


@dataclass(frozen=True)
class Variant:
    """One training program, written plainly and with gpukit.

    ``batch``: the DataLoader's batch size per rank. ``accumulate``: micro-batches per step
    (with ``train_step`` each loader batch is cut into that many; in the plain loop and with
    ``rt.backward`` each loader batch is one micro-batch). ``generator``: the DataLoader gets a
    seeded ``torch.Generator``, as PyTorch's reproducibility notes advise.
    """

    model: Callable[[], nn.Module]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    batch: int = 8
    accumulate: int = 1
    train_step: bool = False
    generator: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # the gpukit Runtime's other settings

    @property
    def plain_key(self) -> tuple[Any, ...]:
        """Variants whose plain programs are the same program (train_step cuts a loader batch
        of batch * accumulate exactly as a plain loader of batch would hand out its samples)."""
        micro = self.batch // self.accumulate if self.train_step else self.batch
        return (self.model, self.optimizer, micro, self.accumulate, self.generator)


VARIANTS = {
    # (a) rt.backward / rt.step, every setting at its default
    "sgd": Variant(_mlp, _sgd),
    # (b) rt.train_step with gpukit train's oom="auto", and rt.log every LOG_EVERY calls
    "train_step": Variant(
        _mlp, _adamw, train_step=True, options={"oom": "auto", "log_every": LOG_EVERY}
    ),
    # (c) accumulation, by rt.backward / rt.step over loader batches, and by train_step cutting
    # each loader batch in two: both are the plain no_sync loop over batches of 4
    "accumulate": Variant(_mlp, _sgd, batch=4, accumulate=2, options={"accumulate": 2}),
    "accumulate_train_step": Variant(
        _mlp, _sgd, batch=8, accumulate=2, train_step=True, options={"accumulate": 2}
    ),
    # (d) BatchNorm (buffers DDP broadcasts from rank 0) and Dropout (the random stream)
    "bn_dropout": Variant(_bn_dropout, _adamw),
    "bn_dropout_generator": Variant(_bn_dropout, _adamw, generator=True),
    # oom="recover" under DDP: gpukit holds DDP's sync back and averages gradients itself
    "bn_dropout_recover": Variant(
        _bn_dropout, _adamw, train_step=True, generator=True, options={"oom": "recover"}
    ),
}


def _snapshot(model: nn.Module, history: list[dict[str, float]]) -> dict[str, Any]:
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "buffers": [name for name, _ in model.named_buffers()],
        "rng": torch.get_rng_state(),
        "history": history,
    }


# -- the plain program, as the DDP tutorial writes it ------------------------------------------


def _plain_train(v: Variant) -> dict[str, Any]:
    torch.manual_seed(SEED)
    model = DistributedDataParallel(v.model())
    optimizer = v.optimizer(model.parameters())
    dataset = _data()
    sampler = DistributedSampler(dataset, shuffle=True, seed=SEED)
    generator = torch.Generator().manual_seed(SEED) if v.generator else None
    micro = v.batch // v.accumulate if v.train_step else v.batch
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, generator=generator)
    history: list[dict[str, float]] = []
    window: list[torch.Tensor] = []
    steps = 0

    def log_window() -> None:
        mean = torch.stack(window).mean()
        dist.all_reduce(mean)
        history.append({"step": float(steps), "loss": mean.item() / WORLD})
        window.clear()

    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % v.accumulate == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss = nn.functional.cross_entropy(model(x), y)
                (loss / v.accumulate).backward()
            window.append(loss.detach())
            if last:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
                if len(window) == LOG_EVERY:
                    log_window()
        if window:  # gpukit's loader reads a window back at the end of each pass
            log_window()
    return _snapshot(model.module, history)


def _plain_worker(rank: int, port: int, outdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        done: dict[tuple[Any, ...], dict[str, Any]] = {}
        for name, v in VARIANTS.items():
            if v.plain_key not in done:
                done[v.plain_key] = _plain_train(v)
            torch.save(done[v.plain_key], Path(outdir) / f"plain-{name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


# -- the same program on gpukit ----------------------------------------------------------------
def _gpukit_train(rt: gk.Runtime, v: Variant) -> dict[str, Any]:
    net = v.model()  # rt seeded torch with SEED when it was made
    dataset = _data()
    generator = torch.Generator().manual_seed(SEED) if v.generator else None
    data = DataLoader(dataset, batch_size=v.batch, shuffle=True, generator=generator)
    model, optimizer, loader = rt.setup(net, v.optimizer(net.parameters()), data)
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    for _ in range(EPOCHS):
        for x, y in loader:
            if v.train_step:
                loss = rt.train_step(optimizer, (x, y), lambda b: criterion(model(b[0]), b[1]))
            else:
                loss = criterion(model(x), y)
                rt.backward(loss)
                rt.step(optimizer)
            rt.log(loss=loss)
    return _snapshot(rt.unwrap(model), rt.history)


def _gpukit_worker(rt: gk.Runtime, outdir: str) -> None:
    for name, v in VARIANTS.items():
        # The first variant trains on the Runtime rt.launch made (seeded when it was made);
        # each other one on a Runtime of its own, as a script under `gpukit launch` makes it.
        own = rt
        if name != "sgd":
            own = gk.Runtime(strategy="ddp", devices=DEVICES, seed=SEED, **v.options)
        try:
            result = _gpukit_train(own, v)
        finally:
            if own is not rt:
                own.teardown()
        torch.save(result, Path(outdir) / f"gpukit-{name}-{rt.rank}.pt")


# -- the comparisons ---------------------------------------------------------------------------
Results = dict[str, list[dict[str, Any]]]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    """Every variant's final state on each rank: ``results["plain-sgd"][rank]``, and so on."""
    outdir = tmp_path_factory.mktemp("ddp-fidelity")
    spawn_plain_program(_plain_worker, str(outdir), WORLD)
    gk.Runtime(strategy="ddp", devices=DEVICES, seed=SEED).launch(_gpukit_worker, str(outdir))
    return {
        f"{side}-{name}": [
            torch.load(outdir / f"{side}-{name}-{rank}.pt", weights_only=False)
            for rank in range(WORLD)
        ]
        for side in ("plain", "gpukit")
        for name in VARIANTS
    }


def _differing(results: Results, name: str, buffers: bool | None = None) -> list[str]:
    """``name``'s tensors that are not bit-identical to the plain program's, on any rank, with
    their largest difference (``buffers``: only buffers, only parameters, or None: both)."""
    out = []
    for rank in range(WORLD):
        plain, ported = results[f"plain-{name}"][rank], results[f"gpukit-{name}"][rank]
        assert plain["tensors"].keys() == ported["tensors"].keys()
        for key, want in plain["tensors"].items():
            got = ported["tensors"][key]
            if buffers is not None and (key in plain["buffers"]) != buffers:
                continue
            if not torch.equal(want, got):
                diff = (want.double() - got.double()).abs().max().item()
                out.append(f"rank {rank} {key} (max abs diff {diff:.3g})")
    return out


def _assert_same_tensors(results: Results, name: str) -> None:
    differ = _differing(results, name)
    assert not differ, f"{name}: not bit-identical to the plain DDP program: {differ}"


def test_backward_and_step_with_default_settings(results: Results) -> None:
    _assert_same_tensors(results, "sgd")


def test_train_step_with_oom_auto_and_logging(results: Results) -> None:
    _assert_same_tensors(results, "train_step")
    for rank in range(WORLD):  # rt.log's means are every rank's, on every rank
        plain = results["plain-train_step"][rank]["history"]
        ported = results["gpukit-train_step"][rank]["history"]
        assert [r["step"] for r in ported] == [r["step"] for r in plain] == [4, 6, 10, 12, 16, 18]
        # rt.log averages float32 values over calls, then sums the ranks' means in float64:
        # its order of additions is its own, so the values agree to rounding, not bit for bit.
        for p, g in zip(plain, ported, strict=True):
            assert g["loss"] == pytest.approx(p["loss"], rel=1e-6, abs=1e-7)


def test_accumulation_equals_no_sync_and_dividing_the_loss(results: Results) -> None:
    _assert_same_tensors(results, "accumulate")
    _assert_same_tensors(results, "accumulate_train_step")


def test_batchnorm_and_dropout(results: Results) -> None:
    # The tutorial's DataLoader has no generator: both loaders draw the workers' base seed
    # from the global generator at each pass, so every dropout mask matches.
    _assert_same_tensors(results, "bn_dropout")


def test_batchnorm_and_dropout_with_a_seeded_loader_generator(results: Results) -> None:
    _assert_same_tensors(results, "bn_dropout_generator")


def test_the_random_stream_moves_as_in_the_plain_program(results: Results) -> None:
    moved = [
        f"{name} rank {rank}"
        for name in VARIANTS
        for rank in range(WORLD)
        if not torch.equal(
            results[f"plain-{name}"][rank]["rng"], results[f"gpukit-{name}"][rank]["rng"]
        )
    ]
    # Each `for x, y in loader` draws the workers' base seed from the global generator, in the
    # plain DataLoader and in gpukit's alike; any later draw (dropout, noise) then matches.
    assert not moved, f"the torch random stream moved differently from the plain program: {moved}"


def test_oom_recover_averages_gradients_like_ddp(results: Results) -> None:
    # Recovery holds DDP's reducer back and averages the gradients itself: all-reduce the sum,
    # then divide by the world size, where DDP's reducer multiplies each gradient by
    # 1 / world_size before the sum. With 2 ranks both are exact scalings by a power of two
    # around one rounded addition, so the results are bit-identical (with 3 ranks they could
    # differ in the last bit).
    differ = _differing(results, "bn_dropout_recover", buffers=False)
    assert not differ, f"parameters not bit-identical to the plain DDP program: {differ}"
    on_rank_0 = [d for d in _differing(results, "bn_dropout_recover") if d.startswith("rank 0")]
    assert not on_rank_0, f"rank 0 not bit-identical to the plain DDP program: {on_rank_0}"


def test_oom_recover_leaves_the_buffers_ddp_leaves(results: Results) -> None:
    # DDP broadcasts rank 0's buffers before each synchronised forward, so after the last step
    # rank 1's BatchNorm statistics are rank 0's from before that step, updated with rank 1's
    # own last batch. Recovery holds DDP's own broadcast back and makes it itself, at the same
    # point (before the attempt's first forward), so rank 1 ends where the plain program does.
    differ = _differing(results, "bn_dropout_recover", buffers=True)
    assert not differ, f"buffers not bit-identical to the plain DDP program: {differ}"
