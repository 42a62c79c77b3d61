"""Saves written in the background (``async_save=True``): the same files as a synchronous
save, from values copied before training goes on; one write in flight at most, a wait said
aloud; a write that fails raises the synchronous path's CheckpointWriteError at the next save,
load or the end; the end of the run waits for the write."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import gpukit as gk
from gpukit import checkpoint as gk_checkpoint
from gpukit.checkpoint import writer
from gpukit.checkpoint.background import Background
from gpukit.errors import CheckpointWriteError, ConfigError
from gpukit.runtime import checkpointing

FILES = ("manifest.json", "model.safetensors", "state.pt")


class Tied(nn.Module):
    """A model whose output layer shares the embedding's weight (written once, by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.embed(x))))


def _run(
    folder: Path, *, async_save: bool, steps: int = 6, save_at: tuple[int, ...] = (2,)
) -> tuple[gk.Runtime, list[float]]:
    """Train ``Tied`` for ``steps`` steps (fp32, CPU), saving after the steps in ``save_at``;
    returns the Runtime (not torn down) and the losses."""
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=folder, async_save=async_save)
    net = Tied()
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    losses = []
    for step in range(1, steps + 1):
        x = torch.randint(0, 16, (4, 5))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        rt.backward(loss)
        rt.step(opt)
        losses.append(loss.item())
        if step in save_at:
            rt.save()
    return rt, losses


@pytest.fixture
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background writes wait at their first file until the event is set (set at the end)."""
    go = threading.Event()
    real = writer.save_file

    def held(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            go.wait(30)
        real(*args, **kwargs)

    monkeypatch.setattr(writer, "save_file", held)
    yield go
    go.set()


def _after(seconds: float, fn: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, fn)
    timer.start()
    return timer


def _same_checkpoints(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for key, tensor in load_file(a / "model.safetensors").items():
        other = load_file(b / "model.safetensors")[key]
        assert torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), key
    left = torch.load(a / "state.pt", weights_only=True)["optimizers"][0]["state"]
    right = torch.load(b / "state.pt", weights_only=True)["optimizers"][0]["state"]
    for i in left:
        for key in left[i]:
            assert torch.equal(left[i][key], right[i][key]), (i, key)


def test_an_async_save_writes_the_files_a_synchronous_save_writes(
    tmp_path: Path, held_writes: threading.Event
) -> None:
    # The write is held until training has gone on for 4 more steps: the files still hold
    # the values of step 2, so what the thread wrote was copied, not the live tensors.
    rt, async_losses = _run(tmp_path / "async", async_save=True)
    held_writes.set()
    rt.teardown()
    rt_sync, sync_losses = _run(tmp_path / "sync", async_save=False)
    rt_sync.teardown()
    assert async_losses == sync_losses
    _same_checkpoints(tmp_path / "async" / "step-00000002", tmp_path / "sync" / "step-00000002")
    assert (tmp_path / "async" / "latest").read_text().strip() == "step-00000002"
    assert "out.weight" not in load_file(tmp_path / "async" / "step-00000002" / "model.safetensors")


def test_training_after_async_saves_goes_on_exactly_as_after_synchronous_ones(
    tmp_path: Path,
) -> None:
    rt, async_losses = _run(tmp_path / "a", async_save=True, steps=9, save_at=(2, 4, 6, 8))
    rt.teardown()
    rt, sync_losses = _run(tmp_path / "s", async_save=False, steps=9, save_at=(2, 4, 6, 8))
    rt.teardown()
    assert async_losses == sync_losses  # bitwise: fp32 on a CPU
    for step in (6, 8):  # keep=3: 4, 6 and 8 are left
        name = f"step-{step:08d}"
        _same_checkpoints(tmp_path / "a" / name, tmp_path / "s" / name)
    assert sorted(p.name for p in (tmp_path / "a").glob("step-*")) == [
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]
    # And the async checkpoint resumes like the synchronous one.
    loaded = []
    for which in ("a", "s"):
        rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path / which, async_save=True)
        net = Tied()
        model, _ = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
        assert rt.load()["step"] == 8
        x = torch.randint(0, 16, (4, 5))
        loaded.append(nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).item())
        rt.teardown()
    assert loaded[0] == loaded[1] == async_losses[8]


def test_a_checkpoint_with_nan_is_kept_aside_as_a_synchronous_save_keeps_it(
    tmp_path: Path,
) -> None:
    manifests = []
    for mode in ("async", "sync"):
        rt, _ = _run(tmp_path / mode, async_save=mode == "async", steps=2, save_at=(1,))
        with torch.no_grad():
            rt.state.modules[0].embed.weight[0, 0] = float("nan")  # tied: two names
        with pytest.warns(UserWarning, match="holds non-finite values"):
            rt.save()
            rt._checkpointing.background.wait()  # the thread's warning, inside this block
        rt.teardown()
        assert (tmp_path / mode / "latest").read_text().strip() == "step-00000001"
        manifests.append((tmp_path / mode / "step-00000002" / "manifest.json").read_bytes())
    assert b"embed.weight has 1 NaN" in manifests[0] and b"out.weight has 1 NaN" in manifests[0]
    assert manifests[0] == manifests[1]


def test_a_second_save_waits_for_the_first_and_says_so(
    tmp_path: Path, held_writes: threading.Event, capsys: pytest.CaptureFixture[str]
) -> None:
    rt, _ = _run(tmp_path, async_save=True, steps=2, save_at=(2,))
    background = rt._checkpointing.background
    assert background.step == 2 and background.writing  # training goes on meanwhile
    assert not (tmp_path / "latest").exists()
    timer = _after(0.3, held_writes.set)
    rt.backward(rt.state.modules[0](torch.zeros(1, 1, dtype=torch.long)).sum())
    rt.save()  # step 2 again: waits for the first
    timer.join()
    said = capsys.readouterr().out
    assert "this save waited" in said and "for the checkpoint of step 2" in said, said
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert gk_checkpoint.problem(tmp_path / "step-00000002") is None


def test_steps_while_a_write_is_in_flight_read_nothing_more(
    tmp_path: Path, held_writes: threading.Event
) -> None:
    """The write runs beside the steps: they read back only what logging reads (one per
    flush), as without it."""
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, async_save=True, log_every=5)
    net = Tied()
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    x = torch.randint(0, 16, (4, 5))

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        rt.backward(loss)
        rt.step(opt)
        rt.log(loss=loss)

    for _ in range(5):
        step()
    rt.flush_logs()
    rt.save()
    with gk.trace() as t:
        for _ in range(10):
            step()
    assert rt._checkpointing.background.writing  # held all along
    assert sum(s.count for s in t.syncs) == 2, [(s.op, s.function) for s in t.syncs]
    held_writes.set()
    rt.teardown()


def test_teardown_waits_for_the_write_in_flight(
    tmp_path: Path, held_writes: threading.Event, capsys: pytest.CaptureFixture[str]
) -> None:
    rt, _ = _run(tmp_path, async_save=True, steps=3, save_at=(3,))
    assert not (tmp_path / "step-00000003").exists()
    timer = _after(0.2, held_writes.set)
    rt.teardown()
    timer.join()
    assert "the end of the run waited" in capsys.readouterr().out
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"
    assert gk_checkpoint.problem(tmp_path / "step-00000003") is None
    assert not list(tmp_path.glob(".tmp*"))


def test_a_load_waits_for_the_write_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go, real = threading.Event(), writer.save_file

    def held(tensors: Any, path: str, **kwargs: Any) -> None:
        if ".tmp-step-00000003" in path:  # step 1's write lands: the one before it is whole
            go.wait(30)
        real(tensors, path, **kwargs)

    monkeypatch.setattr(writer, "save_file", held)
    rt, _ = _run(tmp_path, async_save=True, steps=3, save_at=(1, 3))
    timer = _after(0.2, go.set)  # step 3's write holds until then
    assert rt.load()["step"] == 3  # the checkpoint being written, not the one before it
    assert go.is_set()
    timer.join()
    rt.teardown()


def _refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Background writes fail as a full disk fails them."""

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "save_file", full)


@pytest.mark.parametrize("where", ["next save", "teardown", "load"])
def test_a_failed_background_write_is_the_synchronous_error_at_the_next_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    rt, _ = _run(tmp_path, async_save=True, steps=2, save_at=(1,))
    rt._checkpointing.background.wait()
    _refuse(monkeypatch)
    rt.save()  # step 2: returns, its thread fails
    rt._checkpointing.background.wait()
    monkeypatch.undo()
    with pytest.raises(CheckpointWriteError) as caught:
        if where == "next save":
            rt.save()
        elif where == "load":
            rt.load()
        else:
            rt.teardown()
    text = str(caught.value)
    assert caught.value.errno == errno.ENOSPC, text
    assert f"could not write the checkpoint of step 2 in {tmp_path}" in text, text
    assert "'latest' still names step-00000001" in text, text
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert not list(tmp_path.glob(".tmp*"))
    if where != "teardown":
        assert rt.save().name == "step-00000002"  # the next one goes through
        rt.teardown()
        assert (tmp_path / "latest").read_text().strip() == "step-00000002"


def test_a_disk_without_room_for_the_checkpoint_is_refused_before_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, _ = _run(tmp_path, async_save=True, steps=1, save_at=(1,))
    rt._checkpointing.background.wait()
    real = writer.shutil.disk_usage

    def tight(path: Any) -> Any:
        total, used, _ = real(path)
        return type(real(path))(total, used, 100)  # 100 bytes free

    monkeypatch.setattr(writer.shutil, "disk_usage", tight)
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    assert caught.value.errno == errno.ENOSPC
    text = str(caught.value)
    assert "the disk is full (ENOSPC)" in text and "100 B are free" in text, text
    assert rt._checkpointing.background.step is None  # nothing was started
    assert not list(tmp_path.glob(".tmp*"))
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    monkeypatch.undo()
    rt.teardown()


def test_a_stop_past_its_grace_says_which_step_was_not_saved(tmp_path: Path) -> None:
    background = Background()
    go = threading.Event()
    tmp = tmp_path / ".tmp-step-00000007"
    tmp.mkdir()
    background.start(
        lambda: go.wait(30),
        step=7,
        directory=tmp_path,
        tmp=tmp,
        failures=writer.Failures(),
        needed=0,
    )
    said: list[str] = []
    began = time.monotonic()
    background.settle(checkpointing._Alone(), said.append, "the stop", lambda: began + 0.1)
    assert not go.is_set()  # the write cannot have ended: settle gave up on it (said below)
    assert said and "the checkpoint of step 7 was still being written" in said[0], said
    assert "is not saved" in said[0] and "'latest' still names the previous" in said[0]
    go.set()


def test_async_save_is_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"async_save='yes': use True"):
        gk.Runtime(devices="cpu", async_save="yes")  # type: ignore[arg-type]


# Run in a child process and here alike: fp32 on a CPU, the data from the seeded generator
# that a checkpoint restores.
TRAIN = """
import time
import torch, gpukit as gk
from torch import nn

def train(folder, steps, async_save, resume=False, pause=0.0):
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=folder, save_every=2,
                    async_save=async_save)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    if resume:
        rt.resume()
    losses = {}
    while rt.global_step < steps:
        x = torch.randn(8, 64)
        loss = model(x).pow(2).mean()
        rt.backward(loss)
        rt.step(opt)
        losses[rt.global_step] = loss.item()
        time.sleep(pause)
    rt.teardown()
    return losses
"""

CHILD = """
import pathlib, sys, threading, time
from gpukit.checkpoint import writer
folder, marker = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
real = writer.save_file

def slow(tensors, filename, metadata=None):
    # The write of step 4 starts, then stalls: the kill comes while it is in flight.
    if "step-00000004" in filename:
        real(tensors, filename, metadata=metadata)
        marker.write_text("writing")
        time.sleep(600)
    real(tensors, filename, metadata=metadata)

writer.save_file = slow
exec(TRAIN_SOURCE)
train(folder, 8, True)
"""


@pytest.mark.processes
@pytest.mark.slow
def test_a_kill_during_a_background_write_leaves_the_previous_checkpoint_to_resume(
    tmp_path: Path,
) -> None:
    import os
    import signal
    import subprocess
    import sys

    folder, marker = tmp_path / "ck", tmp_path / "writing"
    script = tmp_path / "child.py"
    script.write_text(CHILD.replace("exec(TRAIN_SOURCE)", TRAIN))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    child = subprocess.Popen([sys.executable, str(script), str(folder), str(marker)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"the child ended early ({child.returncode})"
            assert time.monotonic() < deadline, "the write of step 4 never started"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # from outside, mid-write
        assert child.wait(30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert (folder / ".tmp-step-00000004" / "model.safetensors").is_file()  # cut short
    assert not (folder / "step-00000004").exists()
    assert (folder / "latest").read_text().strip() == "step-00000002"
    assert gk_checkpoint.problem(folder / "step-00000002") is None
    assert gk_checkpoint.resumable(folder) == folder / "step-00000002"

    namespace: dict[str, Any] = {}
    exec(TRAIN, namespace)
    whole = namespace["train"](tmp_path / "whole", 8, False)
    resumed = namespace["train"](folder, 8, True, resume=True)
    assert sorted(resumed) == [3, 4, 5, 6, 7, 8]
    assert resumed == {step: whole[step] for step in resumed}  # bitwise
    assert (folder / "latest").read_text().strip() == "step-00000008"
    assert not list(folder.glob(".tmp*"))  # the cut-short write was cleared away


STOPPED = """
import pathlib, sys, time
from gpukit.checkpoint import writer
folder, marker, stall = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), float(sys.argv[3])
real = writer.save_file

def slow(tensors, filename, metadata=None):
    if "step-00000004" in filename:
        marker.write_text("writing")
        time.sleep(stall)
    real(tensors, filename, metadata=metadata)

writer.save_file = slow
exec(TRAIN_SOURCE)
train(folder, 10**6, True, pause=0.05)
"""


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("stall", [1.0, 600.0])
def test_a_stop_waits_for_the_write_in_flight_within_its_grace(
    tmp_path: Path, stall: float
) -> None:
    """SIGTERM while step 4 is being written: a write that ends in time is kept; one that
    does not (the grace is 4 s) is named as not saved; the stop's own save is made either
    way, and the run exits 143."""
    import os
    import signal
    import subprocess
    import sys

    folder, marker = tmp_path / "ck", tmp_path / "writing"
    script = tmp_path / "child.py"
    script.write_text(STOPPED.replace("exec(TRAIN_SOURCE)", TRAIN))
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "GPUKIT_STOP_GRACE": "4"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(marker), str(stall)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"the child ended early ({child.returncode})"
            assert time.monotonic() < deadline, "the write of step 4 never started"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 143, out
    latest = (folder / "latest").read_text().strip()
    stopped_at = int(latest.removeprefix("step-"))
    assert stopped_at > 4 and f"saved {folder / latest}" in out, out
    assert gk_checkpoint.problem(folder / latest) is None
    if stall < 4:
        assert gk_checkpoint.problem(folder / "step-00000004") is None, out
        assert "waited" in out and "for the checkpoint of step 4" in out, out
    else:
        assert not (folder / "step-00000004").exists()
        assert "the checkpoint of step 4 was still being written" in out, out
        assert "is not saved" in out, out


@pytest.mark.gpu
def test_on_a_gpu_the_copies_are_pinned_and_the_checkpoint_loads_as_a_synchronous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.checkpoint import snapshot

    pinned: list[bool] = []
    real_copy = snapshot.host_copy

    def noted(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        out = real_copy(tensor, into)
        if tensor.device.type == "cuda":
            pinned.append(out.is_pinned())
        return out

    monkeypatch.setattr(snapshot, "host_copy", noted)
    losses = {}
    for mode in ("async", "sync"):
        rt = gk.Runtime(
            devices=["cuda:0"], seed=0, checkpoints=tmp_path / mode, async_save=mode == "async"
        )
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
        model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
        for _ in range(3):
            rt.backward(model(torch.randn(8, 256, device=rt.device)).pow(2).mean())
            rt.step(opt)
        rt.save()
        with torch.no_grad():
            net[0].weight.add_(1.0)  # training goes on while the thread writes
        rt.teardown()
        loaded = gk.Runtime(devices=["cuda:0"], seed=0, checkpoints=tmp_path / mode)
        torch.manual_seed(1)
        net = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
        model, opt = loaded.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
        assert loaded.load()["step"] == 3
        loss = model(torch.ones(8, 256, device=loaded.device)).pow(2).mean()
        loaded.backward(loss)
        loaded.step(opt)
        losses[mode] = [loss.item(), *(p.detach().cpu() for p in net.parameters())]
        loaded.teardown()
    assert pinned and all(pinned)
    a, s = tmp_path / "async" / "step-00000003", tmp_path / "sync" / "step-00000003"
    assert (a / "model.safetensors").read_bytes() == (s / "model.safetensors").read_bytes()
    assert losses["async"][0] == losses["sync"][0]
    for left, right in zip(losses["async"][1:], losses["sync"][1:], strict=True):
        assert torch.equal(left, right)


def _full_disk(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _two_ranks(rt: gk.Runtime, folder: str) -> list[str]:
    net = nn.Linear(32, 32)
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))

    def step() -> None:
        rt.backward(model(torch.ones(2, 32)).sum())
        rt.step(opt)

    step()
    rt.save(folder)  # step 1: written
    step()
    real = writer.save_file
    if rt.rank == 0:  # only rank 0 writes: its thread meets the full disk
        writer.save_file = _full_disk  # type: ignore[assignment]
    rt.save(folder)  # step 2: returns on both ranks
    rt.wait_for_save()  # (this rank's thread has met the full disk)
    writer.save_file = real
    step()
    try:
        rt.save(folder)  # step 3: both ranks learn of step 2 first
        mine = f"rank {rt.rank}: saved"
    except CheckpointWriteError as err:
        mine = f"rank {rt.rank}: {err.errno}: {err}"
    rt.save(folder)  # then the next one goes through
    return rt.strategy.all_gather_object(mine)  # both came back: neither hangs


@pytest.mark.processes
def test_under_two_ranks_a_failed_background_write_is_raised_on_both(tmp_path: Path) -> None:
    rt = gk.Runtime(strategy="ddp", devices=2, seed=0, async_save=True)
    reports = rt.launch(_two_ranks, str(tmp_path))
    assert len(reports) == 2, reports
    for rank, line in enumerate(reports):
        assert line.startswith(
            f"rank {rank}: {errno.ENOSPC}: could not write the checkpoint of step 2 in {tmp_path}"
        ), line
    assert reports[0].split(": ", 2)[2] == reports[1].split(": ", 2)[2]  # one message
    assert (tmp_path / "latest").read_text().strip() == "step-00000003"  # the launch's end waited
    assert not list(tmp_path.glob(".tmp*"))
