"""A save the disk refuses, for real: a full file system (a small tmpfs), a folder nobody may
write (chmod for a user, an immutable folder for root), a file-size limit (RLIMIT_FSIZE: EFBIG).
One clear error naming the folder, the bytes needed and free, and the fix; ``latest`` stays on
the previous checkpoint and nothing of the failed save remains; under two ranks both learn it
and neither hangs."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import checkpoint as gk_checkpoint
from gpukit.errors import CheckpointWriteError

pytestmark = pytest.mark.processes

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or 'not root'})")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB file system of its own (a tmpfs; needs root)."""
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    _mount_tmpfs(where, "1m")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on ``disk``."""
    free = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * max(free - leave, 0))


def _trained(
    checkpoints: Path, size: int = 120
) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=checkpoints, keep=2)
    net = nn.Linear(size, size)
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))
    return rt, model, opt


def _step(rt: gk.Runtime, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    rt.backward(model(torch.ones(2, model.in_features)).sum())
    rt.step(opt)


def _assert_clean_failure(err: CheckpointWriteError, folder: Path, previous: str | None) -> None:
    """One message naming the folder, the bytes and the fix; nothing of the save left; and
    ``latest`` still naming the previous checkpoint."""
    text = str(err)
    assert f"in {folder}" in text and "needs about" in text and "free there" in text, text
    assert "Fix:" in text, text
    assert not list(folder.glob(".tmp*")), list(folder.iterdir())
    if previous is not None:
        assert (folder / "latest").read_text().strip() == previous
        assert gk_checkpoint.problem(folder / previous) is None  # whole


def test_a_full_disk_is_one_clear_error_and_the_previous_checkpoint_stays(
    small_disk: Path,
) -> None:
    folder = small_disk / "ck"
    rt, model, opt = _trained(folder)
    _step(rt, model, opt)
    first = rt.save()
    _fill(small_disk, 100_000)  # less than one more checkpoint (about 170 KiB)
    _step(rt, model, opt)
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    assert caught.value.errno == errno.ENOSPC
    assert isinstance(caught.value, OSError) and isinstance(caught.value, gk.GpukitError)
    assert "the disk is full (ENOSPC)" in str(caught.value)
    _assert_clean_failure(caught.value, folder, first.name)
    assert sorted(p.name for p in folder.iterdir()) == [".gpukit.lock", "latest", first.name]
    assert rt.load()["step"] == 1  # still whole
    rt.teardown()


def test_torch_saves_short_write_on_a_full_disk_is_named_by_the_free_space(
    small_disk: Path,
) -> None:
    # The weights (58 KiB) fit, the optimizer state in state.pt (115 KiB) does not: torch.save
    # fails with "[enforce fail at inline_container.cc] unexpected pos", which has no errno.
    folder = small_disk / "ck"
    rt, model, opt = _trained(folder)
    _step(rt, model, opt)
    folder.mkdir(exist_ok=True)
    _fill(small_disk, 90_000)
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save()
    assert caught.value.errno == errno.ENOSPC, caught.value
    assert "unexpected pos" in str(caught.value.__cause__), caught.value.__cause__
    _assert_clean_failure(caught.value, folder, None)
    rt.teardown()


def test_a_read_only_file_system_is_named(small_disk: Path) -> None:
    folder = small_disk / "ck"
    rt = gk.Runtime(devices="cpu", seed=0)  # rt.save(dir) holds dir only while it writes
    net = nn.Linear(8, 8)
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))
    _step(rt, model, opt)
    first = rt.save(folder)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        _step(rt, model, opt)
        with pytest.raises(CheckpointWriteError) as caught:
            rt.save(folder)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    assert caught.value.errno == errno.EROFS
    assert "read-only (EROFS)" in str(caught.value) and "writable disk" in str(caught.value)
    _assert_clean_failure(caught.value, folder, first.name)
    rt.teardown()


def test_a_runtime_whose_folder_cannot_be_written_is_refused_when_built(
    small_disk: Path,
) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(gk.ConfigError, match=r"ck: cannot create it \(Read-only file sys"):
            gk.Runtime(devices="cpu", checkpoints=small_disk / "ck")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[Path]:
    """A folder this process may not write into: chmod 555 for a user; for root, whom chmod
    does not stop, an immutable folder (chattr +i, ext* and a few others)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"root ignores chmod, and chattr +i fails here: {done.stderr.strip()}")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=False)


def test_a_folder_that_may_not_be_written_is_named(unwritable: Path) -> None:
    rt = gk.Runtime(devices="cpu", seed=0)  # an explicit folder: rt.save(dir)
    net = nn.Linear(4, 4)
    rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(CheckpointWriteError) as caught:
        rt.save(unwritable / "ck")
    assert caught.value.errno in (errno.EACCES, errno.EPERM)
    assert "permission" in str(caught.value).lower() or "not permitted" in str(caught.value)
    assert f"in {unwritable / 'ck'}" in str(caught.value)
    assert list(unwritable.iterdir()) == []
    rt.teardown()


_LIMITED = textwrap.dedent(
    """
    import resource, sys, torch, gpukit as gk
    from torch import nn
    rt = gk.Runtime(devices="cpu", seed=0)
    net = nn.Linear(120, 120)
    opt = torch.optim.AdamW(net.parameters())
    model, opt = rt.setup(net, opt)
    rt.backward(model(torch.ones(2, 120)).sum()); rt.step(opt)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))  # each file at most 40 kB
    try:
        rt.save(sys.argv[1])
    except gk.CheckpointWriteError as err:
        print("ERRNO", err.errno)
        print(err)
    """
)


def test_a_file_size_limit_is_efbig(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(tmp_path / "ck")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"ERRNO {errno.EFBIG}" in done.stdout, done.stdout
    assert "ulimit -f" in done.stdout and "(EFBIG)" in done.stdout, done.stdout
    assert not list((tmp_path / "ck").glob(".tmp*"))


def _both_ranks_fail(rt: gk.Runtime, folder: str) -> str:
    net = nn.Linear(120, 120)
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))
    rt.backward(model(torch.ones(2, 120)).sum())
    rt.step(opt)
    try:
        rt.save(folder)
    except CheckpointWriteError as err:
        return f"rank {rt.rank}: {err.errno}: {err}"
    return f"rank {rt.rank}: saved"


def _report(rt: gk.Runtime, folder: str) -> list[str]:
    mine = _both_ranks_fail(rt, folder)
    return rt.strategy.all_gather_object(mine)  # both came back: neither hangs


def test_under_two_ranks_every_rank_learns_that_the_save_failed(small_disk: Path) -> None:
    _fill(small_disk, 60_000)
    rt = gk.Runtime(strategy="ddp", devices=2, seed=0)
    reports = rt.launch(_report, str(small_disk / "ck"))
    assert len(reports) == 2, reports
    for rank, line in enumerate(reports):
        assert line.startswith(f"rank {rank}: {errno.ENOSPC}: could not write"), line
    assert reports[0].split(": ", 2)[2] == reports[1].split(": ", 2)[2]  # one message
    assert not list((small_disk / "ck").glob(".tmp*"))


def test_a_latest_that_cannot_be_written_leaves_the_new_checkpoint_unpublished(
    tmp_path: Path,
) -> None:
    # A file system out of inodes (not of bytes): the checkpoint's own 4 (its folder and 3
    # files) are there, the file that replaces `latest` is not.
    disk = tmp_path / "inodes"
    _mount_tmpfs(disk, "1m,nr_inodes=64")
    try:
        folder = disk / "ck"
        rt, model, opt = _trained(folder, size=4)
        _step(rt, model, opt)
        first = rt.save()
        spare = os.statvfs(disk).f_ffree - 4
        for i in range(spare):
            (disk / f"f{i}").touch()
        _step(rt, model, opt)
        with pytest.raises(CheckpointWriteError) as caught:
            rt.save()
        assert caught.value.errno == errno.ENOSPC
        assert ".tmp-latest" in str(caught.value.__cause__)  # the files were all written
        _assert_clean_failure(caught.value, folder, first.name)
        assert sorted(p.name for p in folder.iterdir()) == [".gpukit.lock", "latest", first.name]
        rt.teardown()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _sharded_report(rt: gk.Runtime, folder: str) -> list[str]:
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters()))
    rt.backward(model(torch.ones(2, 64)).sum())
    rt.step(opt)
    try:
        rt.save(folder)  # every rank writes its shards: torch.distributed.checkpoint fails
        mine = "saved"
    except CheckpointWriteError as err:
        mine = f"{err.errno}: {err}"
    return rt.strategy.all_gather_object(mine)


def test_under_fsdp_a_shard_the_disk_refuses_fails_every_rank_alike(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "300k")  # the sharded optimizer state alone needs more
    try:
        rt = gk.Runtime(strategy="fsdp", devices=2, seed=0)
        reports = rt.launch(_sharded_report, str(disk / "ck"))
        assert len(reports) == 2 and reports[0] == reports[1], reports
        assert reports[0].startswith(f"{errno.ENOSPC}: could not write the checkpoint"), reports
        assert not (disk / "ck").exists()  # made for the save, nothing in it: removed
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
