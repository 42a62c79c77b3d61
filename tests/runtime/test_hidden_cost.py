"""The training step has no hidden cost: host reads counted with gk.trace(), per strategy and
option. Counts are deterministic (timings are not): on a CPU run every read is recorded as a
potential synchronisation, exactly where a GPU run would wait.

The rule: with the default settings of Runtime and of ``gpukit train``, 30 steps of
``rt.train_step`` + ``rt.log`` with ``log_every=10`` read back 3 times: once per flush, on
every strategy, one process or several. Options that cost more say so, and are counted here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.train.loop import DEFAULT_OOM

STEPS, LOG_EVERY = 30, 10
FLUSHES = STEPS // LOG_EVERY


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches(n: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 8, generator=gen), torch.randint(0, 3, (size,), generator=gen))
        for _ in range(n)
    ]


def _reads(rt: gk.Runtime, manual: bool = False) -> dict[str, Any]:
    """Reads during STEPS steps after two warm-up steps (first-step checks are one-time)."""
    net = _model()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    batches = [gk.to(b, rt.device) for b in _batches(STEPS + 2)]

    def compute_loss(batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    def one(batch: Any) -> torch.Tensor:
        if not manual:
            return rt.train_step(optimizer, batch, compute_loss)
        loss = compute_loss(batch)
        rt.backward(loss)
        rt.step(optimizer)
        return loss

    for batch in batches[:2]:
        one(batch)
    rt.flush_logs()
    with gk.trace() as t:
        for batch in batches[2:]:
            rt.log(loss=one(batch))
    syncs = [(s.op, s.count, s.function) for s in t.syncs]
    return {"reads": sum(s.count for s in t.syncs), "syncs": syncs, "history": len(rt.history)}


@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("single", "cpu"), ("dp", ["cpu", "cpu"]), ("dp-balanced", ["cpu", "cpu"])],
)
@pytest.mark.parametrize("oom", ["raise", DEFAULT_OOM, "recover"])
def test_one_process_reads_once_per_flush(strategy: str, devices: Any, oom: str) -> None:
    rt = gk.Runtime(strategy=strategy, devices=devices, log_every=LOG_EVERY, oom=oom)  # type: ignore[arg-type]
    found = _reads(rt)
    assert found["reads"] == FLUSHES, found["syncs"]


@pytest.mark.parametrize(
    "options",
    [{"accumulate": 2}, {"clip": 1.0}, {"precision": "bf16-mixed"}, {"accumulate": 2, "clip": 0.5}],
)
def test_options_add_no_read(options: dict[str, Any]) -> None:
    rt = gk.Runtime(devices="cpu", log_every=LOG_EVERY, oom=DEFAULT_OOM, **options)  # type: ignore[arg-type]
    assert _reads(rt)["reads"] == FLUSHES
    rt = gk.Runtime(devices="cpu", log_every=LOG_EVERY, **options)
    assert _reads(rt, manual=True)["reads"] == FLUSHES  # rt.backward + rt.step


def _ddp_reads(rt: gk.Runtime, manual: bool) -> dict[str, Any]:
    return _reads(rt, manual)


@pytest.mark.processes
@pytest.mark.parametrize("oom", ["raise", DEFAULT_OOM])
def test_ddp_reads_once_per_flush_with_the_defaults(oom: str) -> None:
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], log_every=LOG_EVERY, oom=oom)  # type: ignore[arg-type]
    found = rt.launch(_ddp_reads, False)
    assert found["reads"] == FLUSHES, found["syncs"]


@pytest.mark.processes
def test_ddp_manual_loop_reads_once_per_flush() -> None:
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], log_every=LOG_EVERY, accumulate=2)
    found = rt.launch(_ddp_reads, True)
    assert found["reads"] == FLUSHES, found["syncs"]


@pytest.mark.processes
def test_ddp_recovery_costs_one_read_per_step_and_says_so() -> None:
    """oom='recover' under several processes holds the gradients back until the ranks agree
    that none failed: one all-reduce and one read per step (documented; not the default)."""
    rt = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], log_every=LOG_EVERY, oom="recover")
    found = rt.launch(_ddp_reads, False)
    assert found["reads"] == FLUSHES + STEPS, found["syncs"]


def test_auto_recovers_in_one_process_and_raises_under_several() -> None:
    assert gk.Runtime(devices="cpu", oom="auto")._stepper.recover
    assert not gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], oom="auto")._stepper.recover
    assert gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], oom="recover")._stepper.recover
    assert gk.Runtime(strategy="dp", devices=["cpu", "cpu"], oom="auto")._stepper.recover


def test_recovery_copies_only_the_buffers_a_step_changes() -> None:
    """The per-step snapshot holds BatchNorm's statistics, not every buffer of the model."""
    rt = gk.Runtime(devices="cpu", oom="recover")
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    net.register_buffer("table", torch.arange(1000.0))  # never changed by the forward
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batch = _batches(1)[0]
    loss = lambda b: nn.functional.cross_entropy(model(b[0]), b[1])  # noqa: E731
    rt.train_step(optimizer, batch, loss)
    guard = rt._stepper.retry._guard
    assert guard is not None
    changing = {guard.names[i] for i in guard.changing or []}
    assert changing == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    saved, _ = rt._stepper.retry.save()
    assert sum(t.numel() for _, t in saved.copies) == 16 + 16 + 1
    assert [guard.names[i] for i, _ in saved.versions] == ["table"]  # only watched by version


def test_clipping_lists_the_parameters_once() -> None:
    rt = gk.Runtime(devices="cpu", clip=1.0)
    net = nn.Linear(4, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(3):
        rt.backward(model(torch.ones(2, 4)).sum())
        rt.step(optimizer)
    first = rt._stepper._params(optimizer)
    assert rt._stepper._params(optimizer) is first
    optimizer.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    assert len(rt._stepper._params(optimizer)) == 3  # a new group is seen
