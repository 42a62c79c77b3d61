"""How long the steps waited for their batches: data_wait in rt.history, the warning when it
is high, and what measuring it costs the step (nothing read back: counted with gk.trace())."""

from __future__ import annotations

import itertools
import time
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpukit as gk
from gpukit.runtime.data import wait
from gpukit.runtime.data.wait import DataWait, advice

KEYS = {"data_wait", "data_wait_fraction"}


class _Slow(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose items take ``seconds`` each to read, from item ``slow_from`` on."""

    def __init__(self, n: int, seconds: float, slow_from: int = 0) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)
        self.seconds, self.slow_from = seconds, slow_from

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i >= self.slow_from:
            time.sleep(self.seconds)
        return self.x[i], self.y[i]


def _train(rt: gk.Runtime, data: Dataset[Any], batch_size: int, **loader: Any) -> None:
    net = nn.Linear(4, 1)
    model, optimizer, batches = rt.setup(
        net, torch.optim.SGD(net.parameters(), lr=0.1), DataLoader(data, batch_size, **loader)
    )
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        rt.log(loss=loss)


def _data_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "waited" in str(w.message)]


def test_each_window_with_batches_records_its_wait_and_a_window_without_none() -> None:
    rt = gk.Runtime(devices="cpu", log_every=3, data_wait=True)
    _train(rt, _Slow(8, 0.0), batch_size=2)  # 4 steps: a window of 3, the pass's end of 1
    rt.log(loss=1.0)  # a window in which no batch was asked for
    rt.flush_logs()
    first, last, without = rt.history
    assert KEYS.issubset(first) and KEYS.issubset(last)
    assert set(without) == {"step", "loss"}
    for record in (first, last):
        assert record["data_wait"] >= 0 and 0 <= record["data_wait_fraction"] <= 1
    assert "data_wait_device" not in first  # CUDA only


def test_the_quantities_as_defined_with_a_fake_clock() -> None:
    """data_wait: seconds inside the loader's next(), the end of the pass included;
    data_wait_fraction: that over the time from the window's first ask to its read-back."""
    ticks = iter([10.0, 10.5, 11.0, 11.25, 12.0, 12.5, 14.0, 15.0])
    meter = DataWait(clock=ticks.__next__)
    meter.warned = True  # (the warning is tested below, with a Runtime)
    batches = meter.timed(iter("ab"), loader=None)
    assert next(batches) == "a"  # 10.0 -> 10.5
    assert next(batches) == "b"  # 11.0 -> 11.25
    assert meter.close(step=2) == {"data_wait": 0.75, "data_wait_fraction": 0.375}  # at 12.0
    assert list(batches) == []  # the end: 12.5 -> 14.0
    assert meter.close(step=3) == {"data_wait": 1.5, "data_wait_fraction": 0.6}  # at 15.0
    assert meter.close(step=4) == {}  # nothing asked for since


class _Event:
    """A CUDA event: its time on the device in ms, and whether it has completed."""

    def __init__(self, ms: float = 0.0, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _Event) -> float:
        assert self.done and end.done, "elapsed_time of an event not complete raises on CUDA"
        return end.ms - self.ms


def test_the_device_wait_is_read_from_completed_events_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ends = iter([_Event(1000.0, done=False), _Event(1000.0), _Event(4000.0)])
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: next(ends))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    meter = DataWait(clock=iter(range(100)).__next__)
    meter.warned = True
    cuda = torch.device("cuda:0")
    meter.device_marks(cuda, _Event(0.0), _Event(100.0))  # 0.1 s waited for a copy
    meter.device_marks(cuda, _Event(500.0), _Event(600.0))
    list(meter.timed(iter("ab"), loader=None))
    meter.before_read()  # its end event is not complete yet: carried to the next window
    assert set(meter.close(step=1)) == KEYS
    list(meter.timed(iter("c"), loader=None))
    meter.before_read()
    values = meter.close(step=2)
    assert values["data_wait_device"] == pytest.approx(0.2)
    assert values["data_wait_device_fraction"] == pytest.approx(0.2)  # of 1 s on the device
    meter.device_marks(cuda, _Event(2000.0), _Event(3000.0))
    list(meter.timed(iter("d"), loader=None))
    meter.before_read()
    values = meter.close(step=3)
    assert values["data_wait_device"] == pytest.approx(1.0)
    assert values["data_wait_device_fraction"] == pytest.approx(0.5)


def test_a_loop_that_never_flushes_keeps_few_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(10_000.0))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "current")
    meter = DataWait(clock=iter(range(1000)).__next__)
    meter.warned = True
    cuda = torch.device("cuda:0")
    for i in range(100):  # each waited 10 ms for its copy
        meter.device_marks(cuda, _Event(100.0 * i), _Event(100.0 * i + 10))
        assert len(meter._marks) <= wait._PENDING + 1
    pending = _Event(20_000.0, done=False)
    meter.device_marks(cuda, _Event(19_000.0), pending)
    list(meter.timed(iter("a"), loader=None))
    meter.before_read()
    assert "data_wait_device" not in meter.close(step=1)  # one copy not complete yet
    pending.done = True
    list(meter.timed(iter("b"), loader=None))
    meter.before_read()
    values = meter.close(step=2)
    assert values["data_wait_device"] == pytest.approx(100 * 0.01 + 1.0)
    assert values["data_wait_device_fraction"] == pytest.approx(2.0 / 10.0)


def test_a_slow_loader_is_warned_about_once_with_its_settings() -> None:
    rt = gk.Runtime(devices="cpu", log_every=3, data_wait=True)
    # 4 windows of 3 steps, each batch 2 items of 20 ms: about 0.12 s of waiting a window.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(rt, _Slow(24, 0.02), batch_size=2)
    (message,) = _data_warnings(caught)
    fraction = rt.history[1]["data_wait_fraction"]
    assert f"waited {fraction:.0%} of their time for batches" in message
    assert "up to step 6" in message  # the second window: the first holds the workers' start
    assert f"num_workers=0: try {min(4, wait._cpus())}" in message or wait._cpus() == 1


def test_a_slow_first_window_alone_is_not_warned_about() -> None:
    """The first window holds the workers' start (and a dataset's first reads): left out."""
    rt = gk.Runtime(devices="cpu", log_every=3, data_wait=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Items 0..5 (the first window's 3 batches) slow, the rest fast.
        _train(rt, _FirstSlow(_Slow(12, 0.05), first=6), batch_size=2)
    assert rt.history[0]["data_wait_fraction"] > wait.WARN_ABOVE
    assert _data_warnings(caught) == []


class _FirstSlow(Dataset[Any]):
    """``inner`` with only its ``first`` items slow (the first window's batches)."""

    def __init__(self, inner: _Slow, first: int) -> None:
        self.inner, self.first = inner, first

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        if i < self.first:
            time.sleep(self.inner.seconds)
        return self.inner.x[i], self.inner.y[i]


def test_a_fast_loader_gives_no_warning() -> None:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 4, generator=gen), torch.randn(256, 1, generator=gen))
    rt = gk.Runtime(devices="cpu", log_every=4, data_wait=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(rt, data, batch_size=8)
    assert _data_warnings(caught) == []
    assert len(rt.history) == 8 and all(KEYS.issubset(r) for r in rt.history)


def test_the_advice_names_each_setting_with_its_value() -> None:
    cuda = torch.device("cuda:0")
    data = list(range(8))
    unpinned = types.SimpleNamespace(loader=DataLoader(data), device=cuda)
    assert advice(unpinned, cpus=16) == ["num_workers=0: try 4", "pin_memory=False: try True"]
    workers = DataLoader(
        data, num_workers=2, persistent_workers=True, prefetch_factor=3, pin_memory=True
    )
    pinned = types.SimpleNamespace(loader=workers, device=cuda)
    assert advice(pinned, cpus=16) == [
        "num_workers=2: try 4",
        "pin_memory=True",
        "prefetch_factor=3: try 6",
    ]
    many = types.SimpleNamespace(num_workers=8, persistent_workers=False, prefetch_factor=2)
    assert advice(many, cpus=8) == [
        "num_workers=8 (this machine has 8 CPUs: make the dataset's __getitem__ faster)",
        "persistent_workers=False: try True (workers start again every pass)",
        "prefetch_factor=2: try 4",
    ]
    assert advice(DataLoader(data), cpus=1) == ["num_workers=0"]


def _steps(setup_loader: bool) -> dict[str, Any]:
    """30 steps of rt.train_step + rt.log (log_every=10) traced, after two warm-up steps:
    batches from the loader rt.setup wrapped, or from the plain DataLoader."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40 * 16, 8), torch.randint(0, 3, (40 * 16,)))
    rt = gk.Runtime(devices="cpu", log_every=10, data_wait=True)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    plain = DataLoader(data, batch_size=16)
    model, optimizer, loader = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3), plain)
    batches = iter(loader if setup_loader else plain)

    def step() -> None:
        loss = rt.train_step(
            optimizer, next(batches), lambda b: nn.functional.cross_entropy(model(b[0]), b[1])
        )
        rt.log(loss=loss)

    for _ in range(2):
        step()
    rt.flush_logs()
    with gk.trace() as t:
        for _ in range(30):
            step()
    return {
        "syncs": [(s.op, s.count) for s in t.syncs],
        "transfers": [(x.kind, x.count) for x in t.transfers],
        "ops": dict(t.ops_per_device),
        "losses": [r["loss"] for r in rt.history],
    }


def test_measuring_the_wait_adds_no_read_copy_or_op_to_the_step() -> None:
    """The default path over rt.setup's loader: one read per flush (3 over 30 steps), no copy,
    as before data_wait was measured; and the same ops and losses as a plain DataLoader's."""
    wrapped, plain = _steps(setup_loader=True), _steps(setup_loader=False)
    assert wrapped["syncs"] == [("tolist", 3)]
    assert wrapped["transfers"] == []
    assert wrapped["ops"] == plain["ops"]
    assert wrapped["losses"] == plain["losses"]  # bitwise: the same floats


@pytest.mark.gpu
def test_on_a_gpu_each_window_records_the_devices_wait() -> None:
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    rt = gk.Runtime(devices="cuda:0", log_every=4, data_wait=True)
    _train(rt, data, batch_size=4)  # 16 steps: 4 windows, each read back after its events
    assert len(rt.history) == 4
    device_keys = {"data_wait_device", "data_wait_device_fraction"}
    assert all((KEYS | device_keys).issubset(r) for r in rt.history)
    for r in rt.history:
        assert r["data_wait_device"] >= 0 and 0 <= r["data_wait_device_fraction"] <= 1


def test_a_program_that_does_not_ask_keeps_its_records_as_it_logged_them() -> None:
    rt = gk.Runtime(devices="cpu", log_every=2)
    loader = rt.setup_loader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2))
    for (x,) in loader:
        rt.log(loss=x.mean())
    assert rt.history and all(set(r) == {"step", "loss"} for r in rt.history)


def test_an_evaluation_pass_is_left_out_of_the_training_window() -> None:
    rt = gk.Runtime(devices="cpu", log_every=100, data_wait=True)
    assert rt._data_wait is not None
    rt._data_wait.clock = itertools.count().__next__  # every wait for a batch counts 1
    model = torch.nn.Linear(4, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    evaluated = rt.setup_loader(DataLoader(_Slow(4, 0.0), batch_size=1))  # no step in its pass
    trained = rt.setup_loader(DataLoader(TensorDataset(torch.ones(4, 4)), batch_size=2))
    with torch.no_grad():
        for x, _ in evaluated:
            model(x)
    for (x,) in trained:
        rt.backward(model(x).sum())
        rt.step(optimizer)
        rt.log(loss=torch.tensor(1.0))
    (record,) = rt.history  # the training pass's end closed the window
    # The training pass's 2 batches and its end, not the evaluation's 4 batches and end.
    assert record["data_wait"] == 3
