"""What a watched rank adds to its heartbeat: the seconds of each phase, the last step's length,
the data phase a set-up loader beats, the samples a step takes and the device's memory; and
that none of it adds a read, a synchronisation or a copy to the step."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import gpukit as gk
from gpukit.launch import heartbeat
from gpukit.launch.heartbeat import PHASES, Heartbeat
from gpukit.lifecycle import watched
from gpukit.lifecycle.watched import WatchedRank, memory_reader


class Clock:
    """time.time() as the heartbeat sees it: moved by hand, or by ``tick`` at each read."""

    def __init__(self, now: float = 1000.0, tick: float = 0.0) -> None:
        self.now, self.tick = now, tick

    def time(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    # The heartbeat module's clock alone: the rest of the process keeps the real one.
    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(time=fake.time, sleep=time.sleep))
    return fake


@pytest.fixture
def launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as rank 0 of a one-rank job a launcher watches."""
    monkeypatch.setenv("GPUKIT_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    return tmp_path


def test_each_phase_gets_the_seconds_until_the_next_beat(tmp_path: Path, clock: Clock) -> None:
    beats = Heartbeat(tmp_path, rank=0)
    took = {"forward": 0.25, "backward": 0.5, "optimizer": 0.125, "loop": 0.0625, "data": 2.0}
    start = clock.now
    beats.beat("forward", 0)  # "start" ran until now: 0 s
    for step in range(3):
        for phase in ("backward", "optimizer", "loop", "data", "forward"):
            previous = beats.phase
            clock.now += took[previous]
            beats.beat(phase, step + (phase in {"loop", "data", "forward"}))
    record = heartbeat.read(tmp_path, 0)
    assert record is not None and len(record.spent) == len(PHASES)
    for phase in ("forward", "backward", "optimizer", "loop", "data"):
        assert record.spent_in(phase) == 3 * took[phase]
    assert sum(record.spent) == clock.now - start  # every second is some phase's
    step_s = sum(took.values())
    assert record.step_ended_at == clock.now - took["data"] - took["loop"]
    assert record.last_step_s == step_s


def test_a_background_save_that_landed_goes_out_with_the_next_beat(tmp_path: Path) -> None:
    beats = Heartbeat(tmp_path, rank=0)
    beats.beat("forward", 4)
    beats.saved_step = 4  # what the write's thread sets when it lands (one writer: the beat)
    beats.beat("backward", 4)
    record = heartbeat.read(tmp_path, 0)
    assert record is not None and record.saved_step == 4  # the launcher knows it is there


def test_the_last_step_is_known_from_the_second_step_end(tmp_path: Path, clock: Clock) -> None:
    beats = Heartbeat(tmp_path, rank=0)
    beats.beat("loop", 1)
    first = heartbeat.read(tmp_path, 0)
    assert first is not None and first.step_ended_at == clock.now and first.last_step_s == 0.0
    clock.now += 0.75
    beats.beat("loop", 2)
    second = heartbeat.read(tmp_path, 0)
    assert second is not None and second.last_step_s == 0.75


def test_the_memory_is_read_at_a_step_end_at_most_once_a_second(
    tmp_path: Path, clock: Clock
) -> None:
    reads = itertools.count(1)
    beats = Heartbeat(tmp_path, rank=0)
    beats.memory_reader = lambda: (next(reads), 0, 0)
    beats.beat("forward", 0)  # not a step end: not read
    record = heartbeat.read(tmp_path, 0)
    assert record is not None and record.memory == (-1, -1, -1)
    for step in range(1, 31):  # 30 step ends over 3 seconds
        clock.now += 0.1
        beats.beat("backward", step - 1)
        beats.beat("loop", step)
    record = heartbeat.read(tmp_path, 0)
    assert record is not None and record.memory[0] == 3  # at 0.1 s, 1.1 s and 2.1 s


def test_the_cuda_reader_takes_the_allocator_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def stats(device: int) -> dict[str, Any]:
        asked.append(device)
        return {
            "allocated_bytes": {"all": {"current": 100, "peak": 300}},
            "reserved_bytes": {"all": {"current": 512}},
        }

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    reader = memory_reader(torch.device("cuda", 1))
    assert reader is not None and reader() == (100, 300, 512) and asked == [1]
    # CUDA not started yet: the allocator has no counters, which is unknown, not zero.
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device: {})
    assert reader() == (-1, -1, -1)
    assert memory_reader(torch.device("cpu")) is None
    asked.clear()
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)
    bare = memory_reader(torch.device("cuda"))  # made without starting CUDA
    assert bare is not None and bare() == (100, 300, 512) and asked == [0]


def test_a_rank_on_a_gpu_tells_its_device_and_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        torch.cuda,
        "memory_stats_as_nested_dict",
        lambda device: {"allocated_bytes": {"all": {"current": 7, "peak": 9}}},
    )
    beats = Heartbeat(tmp_path, rank=0)
    WatchedRank(beats, torch.device("cuda", 2), accumulate=1)
    beats.beat("loop", 1)
    record = heartbeat.read(tmp_path, 0)
    assert record is not None and record.device == 2 and record.memory == (7, 9, -1)
    on_cpu = Heartbeat(tmp_path, rank=1)
    WatchedRank(on_cpu, torch.device("cpu"), accumulate=1)
    assert on_cpu.device == -1 and on_cpu.memory_reader is None


def _loader(n: int = 12, batch_size: int = 4) -> DataLoader[Any]:
    gen = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)),
        batch_size=batch_size,
    )


def _train(rt: gk.Runtime, loader: DataLoader[Any], traced: bool = False) -> gk.Trace | None:
    """Passes over a set-up loader; the last two traced when ``traced``."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, opt, data = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1), loader)
    mse = nn.functional.mse_loss

    def one_pass() -> None:
        for x, y in data:
            loss = mse(model(x), y)
            rt.backward(loss)
            rt.step(opt)
            rt.log(loss=loss)

    one_pass()
    rt.flush_logs()
    if not traced:
        return None
    with gk.trace() as trace:
        one_pass()
        one_pass()
    return trace


class Peeking(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Samples that note the rank's heartbeat as they are read."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.seen = folder, []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen.append(heartbeat.read(self.folder, 0))
        return torch.full((4,), float(i)), torch.ones(1)


def test_a_set_up_loader_beats_the_data_phase(launched: Path, clock: Clock) -> None:
    clock.tick = 0.5  # every beat lasts half a second
    rt = gk.Runtime(strategy="single", devices="cpu", accumulate=2)
    assert rt.lifecycle.watched is not None
    data = Peeking(launched)
    _train(rt, DataLoader(data, batch_size=2))
    # Each sample was read in the data phase, which keeps the line of the last call where
    # ranks met (rt.setup at the first batch: the walk up the stack is for those calls only).
    assert data.seen and all(b is not None and b.phase == "data" for b in data.seen)
    first = data.seen[0].where  # type: ignore[union-attr]
    assert re.fullmatch(r"rt\.setup at test_watched\.py:\d+", first), first
    later = data.seen[-1].where  # type: ignore[union-attr]
    assert re.fullmatch(r"rt\.(backward|step) at test_watched\.py:\d+", later), later
    record = heartbeat.read(launched, 0)
    assert record is not None and record.samples_per_step == 2 * 2
    assert record.spent_in("data") > 0 and record.spent_in("forward") > 0
    # The batch handed: the forward's phase from there (the user's forward runs next).
    with_batch = iter(rt.state.loaders[0])
    next(with_batch)
    handed = heartbeat.read(launched, 0)
    assert handed is not None and handed.phase == "forward"
    rt.teardown()


def test_the_heartbeat_adds_no_read_sync_or_copy_to_the_steps(launched: Path) -> None:
    unwatched = _counts(_train(_unwatched(), _loader(), traced=True))
    rt = gk.Runtime(strategy="single", devices="cpu", log_every=3)
    assert rt.lifecycle.watched is not None
    watched_counts = _counts(_train(rt, _loader(), traced=True))
    rt.teardown()
    assert watched_counts == unwatched and unwatched[0]  # the flushes' reads, at least
    record = heartbeat.read(launched, 0)
    assert record is not None and record.step > 0 and record.samples_per_step == 4


def _unwatched() -> gk.Runtime:
    """The same launched rank, with no heartbeat to write (no launcher watching)."""
    rt = gk.Runtime(strategy="single", devices="cpu", log_every=3)
    rt.lifecycle.heartbeat = None
    rt.lifecycle.watched = None
    return rt


def _counts(trace: gk.Trace | None) -> tuple[list[Any], list[Any], dict[str, int]]:
    assert trace is not None
    syncs = sorted((s.op, s.synchronised, s.count) for s in trace.syncs)
    copies = sorted((c.kind, c.count, c.bytes) for c in trace.transfers)
    return syncs, copies, trace.ops_per_device


def test_without_a_launcher_the_loader_calls_the_runtimes_own_hooks() -> None:
    rt = gk.Runtime(devices="cpu")
    assert rt.lifecycle.heartbeat is None and rt.lifecycle.watched is None

    def handed(loader: Any, position: int, batch: Any) -> None:
        pass

    on_batch, on_handed = rt.lifecycle.loader_hooks(handed)
    assert on_batch == rt.lifecycle.at_boundary and on_handed is handed
    assert watched.memory_reader(torch.device("cpu")) is None
