"""Sharded (fsdp) checkpoints written in the background (``async_save=True``): every rank's
shards copied to host memory in the save and written by a thread on every rank, in the files a
synchronous save writes; one write in flight at most; a failed write on any rank raised on
every rank at the next save; a rank killed mid-write leaves the previous checkpoint to resume,
bit for bit; and the steps meanwhile gain no collective and no host read.

One rank runs in this process (its process group of one); two ranks run as gloo processes
(float64, so that the arithmetic is the same in every run)."""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from gpukit import checkpoint as gk_checkpoint
from gpukit.checkpoint import sharded
from gpukit.errors import CheckpointWriteError
from tests.fsdp_models import VOCAB, TiedLM, assert_bit_identical

pytestmark = pytest.mark.xdist_group("fsdp-async-save")

BATCH = 8  # samples per optimizer step, over all ranks


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TiedLM(VOCAB, depth=2).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _runtime(ranks: int, folder: Path | str, async_save: bool) -> gk.Runtime:
    return gk.Runtime(
        strategy="fsdp",
        devices=["cpu"] * ranks,
        seed=0,
        checkpoints=folder,
        async_save=async_save,
    )


def _step(rt: gk.Runtime, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x, y = _batch(rt.global_step)
    n = BATCH // rt.world_size
    logits = model(x[rt.rank * n : (rt.rank + 1) * n])
    rt.backward(F.cross_entropy(logits.flatten(0, 1), y[rt.rank * n : (rt.rank + 1) * n].flatten()))
    rt.step(optimizer)


def _set_up(rt: gk.Runtime) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model()
    return rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


@pytest.fixture(autouse=True)
def no_process_group_left() -> Iterator[None]:
    """One-rank runs join a process group in this process: none may outlive its test."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background shard writes wait before writing until the event is set (set at the end)."""
    go = threading.Event()
    real = sharded.write

    def held(*args: Any, **kwargs: Any) -> list[str]:
        if threading.current_thread() is not threading.main_thread():
            go.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(sharded, "write", held)
    yield go
    go.set()


def _same_checkpoint(a: Path, b: Path) -> None:
    """The same files with the same bytes, but for what DCP makes new at every save (an id in
    ``sharded/.metadata``) and the manifest's hash of it."""
    from torch.distributed.checkpoint import FileSystemReader

    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    unique = {"manifest.json", "sharded/.metadata"}
    for name in set(names) - unique:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    left, right = (FileSystemReader(str(p / "sharded")).read_metadata() for p in (a, b))
    assert left.state_dict_metadata == right.state_dict_metadata
    assert left.storage_data == right.storage_data
    manifests = [json.loads((p / "manifest.json").read_text()) for p in (a, b)]
    for manifest in manifests:
        del manifest["files"]["sharded/.metadata"]
    assert manifests[0] == manifests[1]
    assert gk_checkpoint.problem(a) is None and gk_checkpoint.problem(b) is None


def test_a_sharded_save_is_written_in_the_background_as_a_synchronous_one(
    tmp_path: Path, held_writes: threading.Event
) -> None:
    # The write is held while training goes on for 3 more steps: the files hold step 2's
    # values, so the thread wrote copies, not the live shards.
    rt = _runtime(1, tmp_path / "async", async_save=True)
    model, optimizer = _set_up(rt)
    for _ in range(2):
        _step(rt, model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "written synchronously" any more
        rt.save()
    background = rt._checkpointing.background
    assert background.step == 2 and background.writing
    assert not (tmp_path / "async" / "latest").exists()
    for _ in range(3):
        _step(rt, model, optimizer)
    held_writes.set()
    rt.teardown()
    rt = _runtime(1, tmp_path / "sync", async_save=False)
    model, optimizer = _set_up(rt)
    for _ in range(2):
        _step(rt, model, optimizer)
    rt.save()
    rt.teardown()
    assert (tmp_path / "async" / "latest").read_text().strip() == "step-00000002"
    _same_checkpoint(tmp_path / "async" / "step-00000002", tmp_path / "sync" / "step-00000002")


def test_a_save_before_the_first_step_leaves_the_optimizer_without_state(
    tmp_path: Path,
) -> None:
    rt = _runtime(1, tmp_path, async_save=True)
    _, optimizer = _set_up(rt)
    rt.save()
    assert not optimizer.state  # laying out its shards gave it one: cleared in the save
    rt.wait_for_save()
    progress = torch.load(tmp_path / "step-00000000" / "state.pt", weights_only=True)
    assert progress["fresh_optimizers"] == [0]
    rt.teardown()


def test_a_second_sharded_save_waits_for_the_first_and_says_so(
    tmp_path: Path, held_writes: threading.Event, capsys: pytest.CaptureFixture[str]
) -> None:
    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    rt.save()
    _step(rt, model, optimizer)
    timer = threading.Timer(0.3, held_writes.set)
    timer.start()
    rt.save()  # waits for step 1's write, then starts step 2's (no longer held)
    timer.join()
    said = capsys.readouterr().out
    assert "this save waited" in said and "for the checkpoint of step 1" in said, said
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert gk_checkpoint.problem(tmp_path / "step-00000001") is None
    assert not list(tmp_path.glob(".tmp*"))


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # fsdp's, in newer torch
    "reduce_scatter_single",
    "all_gather_object",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "new_group",
)


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The collectives called through ``torch.distributed``: the main thread's by name
    ("main"), and the group each other thread's ran on ("others")."""
    main: Counter[str] = Counter()
    others: list[Any] = []

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                main[name] += 1
            else:
                others.append(kwargs.get("group"))
            return real(*args, **kwargs)

        return wrapped

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, counting(name, getattr(dist, name)))
    return {"main": main, "others": others}


def test_steps_while_a_sharded_write_is_in_flight_add_no_collective_or_read(
    tmp_path: Path, held_writes: threading.Event, collectives: dict[str, Any]
) -> None:
    """The steps beside a write make the collectives and host reads they make without one;
    the thread's collectives all run on the background group, made once."""
    main: Counter[str] = collectives["main"]
    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)  # the first step's one-time checks

    def five_steps() -> tuple[Counter[str], int]:
        main.clear()
        with gk.trace() as t:
            for _ in range(5):
                _step(rt, model, optimizer)
        return Counter(main), sum(s.count for s in t.syncs)

    alone = five_steps()  # (fsdp over one rank gathers nothing: gpukit's own are counted)
    rt.save()
    beside_a_write = five_steps()
    assert rt._checkpointing.background.writing  # held all along
    assert beside_a_write == alone
    held_writes.set()
    main.clear()
    rt.save()  # waits for the first; the background group exists already
    assert main["new_group"] == 0
    rt.wait_for_save()
    group = rt.strategy.background_group()
    assert collectives["others"] and all(g is group for g in collectives["others"])
    rt.teardown()


def test_a_failed_sharded_write_is_the_synchronous_error_at_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    rt.save()
    rt.wait_for_save()

    def full(*args: Any, **kwargs: Any) -> list[str]:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sharded, "write", full)
    _step(rt, model, optimizer)
    rt.save()  # returns; its thread fails
    rt.wait_for_save()
    monkeypatch.undo()
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    text = str(caught.value)
    assert caught.value.errno == errno.ENOSPC, text
    assert f"could not write the checkpoint of step 2 in {tmp_path}" in text, text
    assert "'latest' still names step-00000001" in text, text
    assert not list(tmp_path.glob(".tmp*"))
    assert rt.save().name == "step-00000002"  # the next one goes through
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"


def test_a_disk_without_room_for_the_shards_is_refused_before_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    real = shutil.disk_usage

    def tight(path: Any) -> Any:
        total, used, _ = real(path)
        return type(real(path))(total, used, 100)  # 100 bytes free

    monkeypatch.setattr(shutil, "disk_usage", tight)
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC
    assert "100 B are free" in str(caught.value), str(caught.value)
    assert rt._checkpointing.background.step is None  # no thread was started
    assert not list(tmp_path.glob(".tmp*"))
    rt.teardown()


@pytest.mark.gpu
def test_on_a_gpu_the_shards_are_copied_to_pinned_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.checkpoint import snapshot

    pinned: list[bool] = []
    real_copy = snapshot.host_copy

    def noted(tensor: torch.Tensor) -> torch.Tensor:
        out = real_copy(tensor)
        if tensor.device.type == "cuda":
            local = out.to_local() if hasattr(out, "to_local") else out
            pinned.append(local.device.type == "cpu" and local.is_pinned())
        return out

    monkeypatch.setattr(snapshot, "host_copy", noted)
    for mode in ("async", "sync"):
        rt = gk.Runtime(
            strategy="fsdp",
            devices=["cuda:0"],
            seed=0,
            checkpoints=tmp_path / mode,
            async_save=mode == "async",
        )
        model = _model().to(rt.device)
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for _ in range(2):
            x, y = (t.to(rt.device) for t in _batch(rt.global_step))
            rt.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
            rt.step(optimizer)
        rt.save()
        rt.teardown()
    assert pinned and all(pinned), pinned
    _same_checkpoint(tmp_path / "async" / "step-00000002", tmp_path / "sync" / "step-00000002")


# Two ranks, as gloo processes. Each background write first waits a little, so that it runs
# beside the steps that follow it (and the next save may wait for it).
STEPS = 8


def _slow_writes(rank: int, fault: str | None) -> None:
    """In a rank's process: background shard writes take a while; with ``fault``, rank 1's
    write of step 4 fails as a full disk fails it ("full"), or rank 1 is killed once its
    shards of step 4 are written, before it described them ("kill")."""
    real = sharded.write

    def write(staged: Any, folder: Path, rank_: int, group: Any) -> list[str]:
        time.sleep(0.2)
        step_4 = "step-00000004" in str(folder) and rank == 1
        if fault == "full" and step_4:
            real_fsync = os.fsync

            def refused(fd: int) -> None:  # DCP fsyncs each file it writes
                raise OSError(errno.ENOSPC, "No space left on device")

            os.fsync = refused
            try:
                return real(staged, folder, rank_, group)
            finally:
                os.fsync = real_fsync
        found = real(staged, folder, rank_, group)
        if fault == "kill" and step_4:
            os.kill(os.getpid(), signal.SIGKILL)
        return found

    sharded.write = write  # type: ignore[assignment]


def _train(
    rt: gk.Runtime, save_at: list[int], fault: str | None = None, resume: bool = False
) -> dict[str, Any]:
    """Train to STEPS, saving after the steps in ``save_at`` (retrying a save that raised a
    write failure); returns the full weights and every rank's errors."""
    if rt.config.async_save:
        _slow_writes(rt.rank, fault)
    model, optimizer = _set_up(rt)
    if resume:
        rt.resume()
    out: dict[str, Any] = {"resumed_at": rt.global_step}
    errors = []
    while rt.global_step < STEPS:
        _step(rt, model, optimizer)
        if rt.global_step in save_at:
            try:
                rt.save()
            except CheckpointWriteError as err:  # an earlier write's failure
                errors.append(f"{err.errno}: {err}")
                rt.save()
    out["errors"] = rt.strategy.all_gather_object(errors)
    out["weights"] = _full(model)
    return out


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks saving synchronously after steps 2, 4 and 6."""
    folder = tmp_path_factory.mktemp("fsdp-sync") / "ck"
    run = _runtime(2, folder, async_save=False).launch(_train, [2, 4, 6])
    run["folder"] = folder
    return run


@pytest.mark.processes
def test_two_ranks_saving_behind_train_and_write_as_with_synchronous_saves(
    synchronous: dict[str, Any], tmp_path: Path
) -> None:
    """Rank 1's write of step 4 fails: both ranks raise the same error at the next save,
    which then goes through; training is untouched and step 6 holds what a synchronous save
    wrote."""
    folder = tmp_path / "ck"
    run = _runtime(2, folder, async_save=True).launch(_train, [2, 4, 6], "full")
    assert_bit_identical(run["weights"], synchronous["weights"])
    first, second = run["errors"]
    assert len(first) == len(second) == 1 and first == second, run["errors"]
    assert first[0].startswith(f"{errno.ENOSPC}: could not write the checkpoint of step 4"), first
    assert "'latest' still names step-00000002" in first[0], first
    assert sorted(p.name for p in folder.iterdir()) == [
        ".gpukit.lock",
        "latest",
        "step-00000002",
        "step-00000006",
    ]
    for step in ("step-00000002", "step-00000006"):
        _same_checkpoint(folder / step, synchronous["folder"] / step)


@pytest.mark.processes
def test_a_rank_killed_during_a_sharded_write_leaves_the_previous_checkpoint(
    synchronous: dict[str, Any], tmp_path: Path
) -> None:
    folder = tmp_path / "ck"
    with pytest.raises(gk.LaunchError, match="rank 1 was killed by SIGKILL"):
        _runtime(2, folder, async_save=True).launch(_train, [2, 4, 6], "kill")
    # Every shard of step 4 was written, but rank 1 never described its own: not published
    # (rank 0's thread, its gather cut short, removes the folder it began).
    assert not (folder / "step-00000004").exists()
    assert (folder / "latest").read_text().strip() == "step-00000002"
    assert gk_checkpoint.problem(folder / "step-00000002") is None
    # Resumed from the checkpoint written in the background: the weights of the run that
    # saved synchronously and never stopped, bit for bit.
    resumed = _runtime(2, folder, async_save=True).launch(_train, [4, 6], None, True)
    assert resumed["resumed_at"] == 2
    assert_bit_identical(resumed["weights"], synchronous["weights"])
    assert (folder / "latest").read_text().strip() == "step-00000006"
    assert not list(folder.glob(".tmp*"))


def test_rank_0_does_not_count_a_step_another_rank_failed_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0's own part went well, but another rank's did not (a second rank that failed, as
    # the gather of the ranks' outcomes tells it): the checkpoint is removed, not published,
    # and rank 0 must not count its step as saved (its heartbeat says so to the launcher).
    from gpukit.checkpoint import sharded_behind

    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    real = sharded_behind._all_gather_object

    def another_failed(obj: Any, group: Any) -> list[Any]:
        return [*real(obj, group), ({}, [], False)]

    monkeypatch.setattr(sharded_behind, "_all_gather_object", another_failed)
    rt.save()
    rt.wait_for_save()
    assert not (tmp_path / "step-00000001").exists() and not list(tmp_path.glob(".tmp*"))
    assert rt.lifecycle.saved_step == -1
    assert rt.lifecycle.in_flight == 1
    monkeypatch.undo()
    rt.teardown()


def test_the_room_checked_for_a_sharded_save_counts_the_exported_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Room for the shards (weights and optimizer state) but not for the full weights the
    # export writes beside them: refused in the save, not found half way through the write.
    import shutil

    from gpukit.checkpoint.failure import needed_bytes

    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    shards = needed_bytes(rt._checkpointing.state.modules, [optimizer])
    real = shutil.disk_usage

    def tight(path: Any) -> Any:
        total, used, _ = real(path)
        return type(real(path))(total, used, shards + 1)

    monkeypatch.setattr(shutil, "disk_usage", tight)
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    assert caught.value.errno == errno.ENOSPC
    assert rt._checkpointing.background.step is None  # no thread was started
    rt.save(export=False)  # the shards alone fit
    monkeypatch.undo()
    rt.teardown()
    assert (tmp_path / "latest").read_text().strip() == "step-00000001"
    assert not (tmp_path / "step-00000001" / "model.safetensors").exists()


def test_a_save_beside_a_sharded_write_given_up_is_written_in_the_save(
    tmp_path: Path, held_writes: threading.Event
) -> None:
    # A stop gave up waiting for a write that still runs on its thread, its collectives on
    # the background group. A second write there would run beside it, the two threads'
    # collectives matched differently on each rank: the next save is written synchronously.
    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    rt.save()  # held
    background = rt._checkpointing.background
    assert not background.settle(rt.strategy, print, "a stop", lambda: 0.0)  # given up
    _step(rt, model, optimizer)
    rt.save()
    assert background.step is None  # no write handed to a thread
    assert rt.lifecycle.saved_step == 2 and rt.lifecycle.in_flight is None
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    assert gk_checkpoint.problem(tmp_path / "step-00000002") is None
    held_writes.set()
    rt.teardown()


def test_the_writing_thread_works_on_the_ranks_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # A new thread's current GPU is GPU 0; DCP's writer synchronises the current device's
    # stream even for host copies, which on rank k would make a context on GPU 0.
    from gpukit.checkpoint import sharded_behind

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    sharded_behind.use_device(torch.device("cpu"))
    sharded_behind.use_device(torch.device("cuda", 1))
    assert chosen == [torch.device("cuda", 1)]


def test_the_writing_thread_is_put_on_the_ranks_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.checkpoint import sharded_behind

    used: list[tuple[bool, torch.device]] = []
    real = sharded_behind.use_device

    def recorded(device: torch.device) -> None:
        used.append((threading.current_thread() is threading.main_thread(), device))
        real(device)

    monkeypatch.setattr(sharded_behind, "use_device", recorded)
    rt = _runtime(1, tmp_path, async_save=True)
    model, optimizer = _set_up(rt)
    _step(rt, model, optimizer)
    rt.save()
    rt.wait_for_save()
    assert used == [(False, rt.strategy.device.torch)]
    rt.teardown()
