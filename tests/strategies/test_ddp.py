"""DDP for real: 2 gloo processes on 127.0.0.1, compared with one process."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gpukit as gk
from gpukit.errors import LaunchError

GLOBAL_BATCH = 16


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(80, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _train(rt: gk.Runtime, epochs: int, shuffle: bool) -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    per_rank = GLOBAL_BATCH // rt.world_size // rt.accumulate
    loader = DataLoader(_data(), batch_size=per_rank, shuffle=shuffle)
    if shuffle and rt.world_size == 1:
        # One process keeps a DataLoader's own RandomSampler, as plain PyTorch would; the order
        # the ranks split between them is a DistributedSampler's with the run's seed.
        order = DistributedSampler(_data(), num_replicas=1, rank=0, seed=0)
        loader = DataLoader(_data(), batch_size=per_rank, sampler=order)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
            rt.log(loss=loss)
    assert rt.global_step == epochs * 80 // GLOBAL_BATCH
    return {k: v.numpy() for k, v in rt.unwrap(model).state_dict().items()}


@pytest.mark.processes
@pytest.mark.parametrize(("accumulate", "shuffle"), [(1, True), (2, False)])
def test_two_processes_match_one_on_the_same_global_batch(accumulate: int, shuffle: bool) -> None:
    single = gk.Runtime(devices="cpu", seed=0, accumulate=accumulate).launch(_train, 2, shuffle)
    ddp = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], seed=0, accumulate=accumulate)
    assert ddp.strategy.needs_launch
    distributed = ddp.launch(_train, 2, shuffle)
    assert distributed.keys() == single.keys()
    for name in single:
        diff = np.abs(distributed[name] - single[name]).max()
        assert diff <= 1e-6, f"{name}: max abs diff {diff}"


def _fail_on_rank_one(rt: gk.Runtime, folder: str) -> None:
    # Before setup, which every rank enters together: rank 1 cannot fail before this is written.
    Path(folder, f"pid{rt.rank}").write_text(str(os.getpid()))
    rt.setup(nn.Linear(1, 1))
    if rt.rank == 1:
        raise ValueError("boom on rank 1")
    # Rank 0 waits without a collective (one would fail by itself once rank 1 is gone), so only
    # being stopped ends it early; the bound keeps a regression from hanging the suite.
    for _ in range(1200):
        time.sleep(0.1)
    Path(folder, "rank0-went-on").write_text("")


@pytest.mark.processes
def test_a_failing_rank_stops_the_job_and_shows_its_traceback(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as err:
        gk.Runtime(devices=2).launch(_fail_on_rank_one, str(tmp_path))
    text = str(err.value)
    assert text.startswith("rank 1 failed") and "ValueError: boom on rank 1" in text
    assert "Traceback" in text and "_fail_on_rank_one" in text
    # Rank 0 was stopped rather than waited for: it never went on, and its process is gone.
    assert not (tmp_path / "rank0-went-on").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "pid0").read_text()), 0)


def _train_steps(rt: gk.Runtime) -> dict[str, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data().tensors
    for i in range(3):
        batch = (x[16 * i : 16 * (i + 1)], y[16 * i : 16 * (i + 1)])
        rt.train_step(optimizer, batch, lambda b: F.mse_loss(model(b[0]), b[1]))
    return {
        "wrapped": type(model).__name__,
        "group": dist.get_world_size() if dist.is_initialized() else None,
        "weights": [p.detach().clone() for p in rt.unwrap(model).parameters()],
    }


def test_ddp_on_one_device_is_a_process_group_of_one() -> None:
    # No launcher, one device: DDP runs here, in a process group of one, with the same result
    # as one plain process.
    rt = gk.Runtime(strategy="ddp", devices=1, seed=0)
    assert rt.world_size == 1 and not rt.strategy.needs_launch
    try:
        ddp = rt.launch(_train_steps)
    finally:
        rt.teardown()
    assert not dist.is_initialized()  # the group of one is gone with the Runtime
    single = gk.Runtime(strategy="single", devices="cpu", seed=0).launch(_train_steps)
    assert ddp["wrapped"] == "DistributedDataParallel" and ddp["group"] == 1
    for a, b in zip(ddp["weights"], single["weights"], strict=True):  # type: ignore[call-overload]
        assert torch.equal(a, b)


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class _OomInBackward(torch.autograd.Function):
    """Runs out of memory in the backward of micro-batches over 4 samples."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.samples = x.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.samples > 4:
            raise _OOM(
                "CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 10.76 GiB total "
                "capacity; 9.12 GiB already allocated; 51.69 MiB free; 9.45 GiB reserved in "
                "total by PyTorch)"
            )
        return grad


class _OomNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(_OomInBackward.apply(self.first(x)).tanh())


def _recover_in_backward(rt: gk.Runtime) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = _OomNet()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = _data().tensors
    for i in range(3):
        batch = (x[8 * i : 8 * (i + 1)], y[8 * i : 8 * (i + 1)])
        rt.train_step(optimizer, batch, lambda b: F.mse_loss(model(b[0]), b[1]))
    return [p.detach().clone() for p in rt.unwrap(model).parameters()]


def test_one_ddp_process_recovers_from_running_out_of_memory_in_the_backward() -> None:
    # DDP's reducer is left waiting by a backward that failed halfway, even with one rank: the
    # redone step must not go through it (it would fail with "Expected to have finished
    # reduction in the prior iteration").
    rt = gk.Runtime(strategy="ddp", devices=1, seed=0, oom="recover")
    try:
        ddp = rt.launch(_recover_in_backward)
    finally:
        rt.teardown()
    single = gk.Runtime(devices="cpu", seed=0, oom="recover").launch(_recover_in_backward)
    assert rt.oom_events and rt.oom_split == 2
    for a, b in zip(ddp, single, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(2, 1)
        self.unused = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_and_collectives(rt: gk.Runtime) -> dict[str, object]:
    model = rt.setup(_HalfUsed())
    mean = rt.all_reduce(torch.tensor([float(rt.rank)]))
    biggest = rt.all_reduce(torch.tensor([float(rt.rank)]), op="max")
    rt.log(value=float(rt.rank))
    logged = rt.flush_logs()
    try:
        rt.backward(model(torch.ones(4, 2)).sum())
    except gk.ConfigError as err:
        return {"error": str(err), "mean": mean.item(), "max": biggest.item(), "log": logged}
    return {"error": None}


@pytest.mark.processes
def test_unused_parameters_are_named_with_the_fix_and_collectives_work() -> None:
    out = gk.Runtime(devices=["cpu", "cpu"]).launch(_unused_and_collectives)
    assert "unused.weight, unused.bias" in str(out["error"])
    assert "find_unused_parameters=True" in str(out["error"])
    assert out["mean"] == 0.5 and out["max"] == 1.0 and out["log"]["value"] == 0.5


def _use_half(rt: gk.Runtime) -> float:
    model = rt.setup(_HalfUsed())
    for _ in range(2):
        rt.backward(model(torch.ones(4, 2)).sum())
    return float(rt.unwrap(model).used.weight.grad.sum())


@pytest.mark.processes
def test_find_unused_parameters_option_lets_it_train() -> None:
    strategy = gk.strategies.DDP(find_unused_parameters=True)
    assert gk.Runtime(strategy=strategy, devices=2).launch(_use_half) == pytest.approx(16.0)


def _barrier_first_then_big_result(rt: gk.Runtime) -> torch.Tensor:
    rt.barrier()  # before setup: the process group must already be there
    return torch.arange(300_000, dtype=torch.float32)  # far more than a pipe's buffer


@pytest.mark.processes
def test_collectives_before_setup_and_a_large_result() -> None:
    result = gk.Runtime(devices=2).launch(_barrier_first_then_big_result)
    assert result.shape == (300_000,) and float(result[-1]) == 299_999.0


def _log_different_names(rt: gk.Runtime) -> None:
    rt.log(**{f"metric{rt.rank}": 1.0})
    rt.flush_logs()


@pytest.mark.processes
def test_different_metric_names_on_ranks_are_an_error_not_a_hang() -> None:
    with pytest.raises(gk.ConfigError, match=r"rank \d: rt\.log got different metric names"):
        gk.Runtime(devices=2).launch(_log_different_names)


def _log_changing_names(rt: gk.Runtime) -> list[dict[str, float]]:
    rt.log(loss=float(rt.rank))
    rt.flush_logs()
    rt.log(loss=2.0, acc=float(rt.rank))  # a new metric, on every rank alike: fine
    rt.flush_logs()
    if rt.rank == 0:
        rt.log(loss=1.0, extra=1.0)  # one more name here than on the other rank
    else:
        rt.log(loss=1.0)
    try:
        rt.flush_logs()
    except gk.ConfigError as err:
        return [*rt.history, {"error": str(err)}]  # type: ignore[dict-item]
    return rt.history


@pytest.mark.processes
def test_metric_names_may_change_together_and_a_different_count_is_caught() -> None:
    history = gk.Runtime(devices=2).launch(_log_changing_names)
    assert history[0] == {"step": 0.0, "loss": 0.5}
    assert history[1] == {"step": 0.0, "acc": 0.5, "loss": 2.0}
    assert "different metric names" in history[2]["error"]  # type: ignore[operator]


def _mixed_precision_inside_ddp(rt: gk.Runtime, folder: str) -> dict[str, object]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    reduced: list[int] = []

    def counting(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
        reduced.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    model.register_comm_hook(None, counting)
    flags = (model.require_backward_grad_sync, model.require_forward_param_sync)
    batch = (torch.randn(8, 4), torch.randint(0, 2, (8,)))
    loss = rt.train_step(optimizer, batch, lambda b: F.cross_entropy(model(b[0]), b[1]))
    keys = list(model.state_dict())
    model.load_state_dict(model.state_dict())  # the keys DDP saves load back through it
    rt.save(folder)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        for p in net.parameters():
            p.zero_()
    rt.load(folder)
    restored = all(torch.equal(saved[k], v) for k, v in net.state_dict().items())
    return {
        "outer": type(model).__name__,
        "inner": type(model.module).__name__,
        "user": rt.unwrap(model) is net,
        "flags_after_setup": flags,
        "reducer_calls": len(reduced),
        "loss_dtype": str(loss.dtype),
        "keys": keys[:2],
        "restored": restored,
    }


@pytest.mark.processes
def test_mixed_precision_sits_inside_ddp_so_its_switches_hold(tmp_path: Path) -> None:
    """Autocast is inside DDP: DDP's no-sync and buffer switches, which gpukit sets for
    accumulation and out-of-memory recovery, are on the outermost module; checkpoints and
    state dicts keep DDP's own keys."""
    rt = gk.Runtime(
        strategy="ddp",
        devices=["cpu", "cpu"],
        precision="bf16-mixed",
        accumulate=2,
        oom="recover",
    )
    out = rt.launch(_mixed_precision_inside_ddp, str(tmp_path))
    assert (out["outer"], out["inner"], out["user"]) == (
        "DistributedDataParallel",
        "MixedPrecision",
        True,
    )
    assert out["flags_after_setup"][0] is False  # the first micro-batch does not all-reduce
    assert out["reducer_calls"] == 0  # held back: gpukit averages after the ranks agree
    assert out["loss_dtype"] == "torch.float32"
    assert out["keys"] == ["module.0.weight", "module.0.bias"]
    assert out["restored"] is True


def _only_rank_0_logs(rt: gk.Runtime) -> None:
    if rt.rank == 0:
        rt.log(loss=1.0)
    rt.flush_logs()


@pytest.mark.processes
def test_a_rank_that_logged_nothing_still_joins_the_flush() -> None:
    with pytest.raises(gk.ConfigError, match=r"rank \d: rt\.log got different metric names"):
        gk.Runtime(devices=2).launch(_only_rank_0_logs)
