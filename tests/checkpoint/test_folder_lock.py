"""One run per folder: a Runtime's checkpoints folder and gpukit train's --out are locked by a
real OS lock, held by real processes here, freed when they die; pruning leaves alone what this
run did not write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.checkpoint import files
from gpukit.checkpoint import lock as folder_lock
from gpukit.train.outdir import check_out, claim_out

SRC = str(Path(__file__).resolve().parents[2] / "src")

pytestmark = pytest.mark.skipif(folder_lock.fcntl is None, reason="no fcntl: folders unlocked")

# A program that holds a Runtime on a checkpoints folder, says so, and waits to be killed.
_HOLDER = textwrap.dedent(
    """
    import sys, time, gpukit as gk
    rt = gk.Runtime(devices="cpu", checkpoints=sys.argv[1])
    print("holding", flush=True)
    time.sleep(600)
    """
)


def _start_holder(folder: Path) -> subprocess.Popen[str]:
    """Another process holding ``folder`` with a Runtime, once it says so."""
    env = {**os.environ, "PYTHONPATH": SRC}
    for name in ("RANK", "WORLD_SIZE", "GPUKIT_JOB_DIR"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc


@dataclass(frozen=True)
class Held:
    """A folder and the other process holding it."""

    folder: Path
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    """A folder another process holds, shared by the tests that leave holder and folder as
    they found them (a cold start of the holder costs seconds: torch's import)."""
    folder = tmp_path_factory.mktemp("held") / "ckpt"
    proc = _start_holder(folder)
    yield Held(folder, proc)
    proc.kill()
    proc.wait()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding ``tmp_path/ckpt``, for a test that kills it."""
    proc = _start_holder(tmp_path / "ckpt")
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.processes
def test_a_second_runtime_on_a_held_folder_is_refused_naming_the_holder(held: Held) -> None:
    with pytest.raises(gk.ConfigError) as caught:
        gk.Runtime(devices="cpu", checkpoints=held.folder)
    text = str(caught.value)
    assert f"is in use by pid {held.proc.pid} on host " in text, text
    assert " since 20" in text and "another checkpoints folder" in text, text


@pytest.mark.processes
def test_the_lock_is_freed_when_its_holder_is_killed(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    rt = gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt")  # the kernel freed it
    assert folder_lock.holder(tmp_path / "ckpt").pid == os.getpid()  # type: ignore[union-attr]
    rt.teardown()
    assert not (tmp_path / "ckpt" / folder_lock.LOCK_FILE).exists()


@pytest.mark.processes
def test_out_held_by_another_process_is_refused_by_claim_out(held: Held) -> None:
    with pytest.raises(gk.ConfigError, match=r"in use by pid \d+ .*use another --out"):
        claim_out(str(held.folder))


@pytest.mark.processes
def test_a_save_into_a_folder_another_run_holds_is_refused_and_touches_nothing(
    held: Held,
) -> None:
    leftover = held.folder / ".tmp-step-00000009"  # the holder's save under way
    leftover.mkdir()
    try:
        rt = gk.Runtime(devices="cpu")
        rt.setup(torch.nn.Linear(2, 1))
        with pytest.raises(
            gk.ConfigError, match=rf"in use by pid {held.proc.pid} .*another folder"
        ):
            rt.save(held.folder)
        assert sorted(p.name for p in held.folder.iterdir()) == [
            folder_lock.LOCK_FILE,
            leftover.name,
        ]
        rt.teardown()
    finally:
        leftover.rmdir()  # the folder as the other tests of the held folder expect it


def test_runtimes_of_this_very_process_share_the_folder(tmp_path: Path) -> None:
    first = gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt")
    second = gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt")  # a notebook's rerun
    second.teardown()
    assert folder_lock.held_here(tmp_path / "ckpt")  # the first still holds it
    first.teardown()
    assert not folder_lock.held_here(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()  # made for the lock, left empty: removed


@pytest.mark.processes
def test_a_process_started_by_the_holder_is_of_its_job(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": SRC}
    code = "import sys, gpukit as gk; gk.Runtime(devices='cpu', checkpoints=sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ckpt")], env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr
    rt.teardown()


@pytest.mark.processes
def test_a_warm_rank_counts_the_launcher_that_asked_for_it_as_its_parent(
    held: Held, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank forked by the warm-start server descends from the server, not from the program
    # that holds the folder and launched it: GPUKIT_WARM_PARENT names that program.
    with pytest.raises(gk.ConfigError, match="is in use by pid"):
        gk.Runtime(devices="cpu", checkpoints=held.folder)
    monkeypatch.setenv("GPUKIT_WARM_PARENT", str(held.proc.pid))
    # Of the holder's job, it shares the lock: its teardown leaves the holder's lock file.
    gk.Runtime(devices="cpu", checkpoints=held.folder).teardown()
    assert (held.folder / folder_lock.LOCK_FILE).is_file()


def test_overwrite_moves_the_checkpoints_aside_but_keeps_the_lock_in_place(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    (out / "checkpoints" / "step-00000004").mkdir(parents=True)
    (out / "checkpoints" / "step-00000004" / "state.pt").write_bytes(b"x")
    lock = claim_out(str(out))
    rt = gk.Runtime(devices="cpu", checkpoints=out / "checkpoints")
    with pytest.warns(UserWarning, match="moved to"):
        check_out(str(out), resume=False, overwrite=True)
    assert (out / "checkpoints" / folder_lock.LOCK_FILE).is_file()
    assert not files.has_checkpoints(out / "checkpoints")
    rt.teardown()
    assert lock is not None
    lock.release()


def test_pruning_removes_only_gpukit_checkpoints(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "step-00000001").mkdir(parents=True)
    (folder / "step-00000001" / "notes.txt").write_text("not a checkpoint")
    rt = gk.Runtime(devices="cpu", checkpoints=folder, keep=1)
    model = rt.setup(torch.nn.Linear(2, 1))
    for step in (2, 3):
        rt.state.global_step = step
        rt.save()
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000001", "step-00000003"]
    rt.teardown()
    del model


def test_leftovers_of_a_save_are_removed_only_under_the_lock(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    saved = folder / "step-00000002"
    leftover = folder / ".tmp-step-00000009"
    for path in (saved, leftover):
        path.mkdir(parents=True)
        (path / "state.pt").write_bytes(b"x")
    files.prune(folder, 1, saved, leftovers=False)  # another run may be writing it
    assert leftover.is_dir()
    files.prune(folder, 1, saved)
    assert not leftover.exists()


def _two_steps(rt: gk.Runtime) -> str:
    net = torch.nn.Linear(2, 1)
    model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(2):
        rt.backward(model(torch.ones(2, 2)).sum())
        rt.step(opt)  # saves after each step (save_every=1)
    holder = folder_lock.holder(rt.lifecycle.folder)  # type: ignore[arg-type]
    return f"{os.getppid()} {holder.pid if holder else None}"


# Cold: it checks that the ranks' parent is this process (a forked rank's is the server).
@pytest.mark.cold_start
@pytest.mark.processes
def test_ranks_started_by_the_holder_run_under_its_lock(tmp_path: Path) -> None:
    rt = gk.Runtime(strategy="ddp", devices=2, checkpoints=tmp_path / "ckpt", save_every=1)
    parent, held_by = rt.launch(_two_steps).split()
    assert parent == held_by == str(os.getpid())  # this process holds it for its ranks
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000002"
    rt.teardown()
    assert not (tmp_path / "ckpt" / folder_lock.LOCK_FILE).exists()


_FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time, gpukit as gk
    rt = gk.Runtime(devices="cpu", checkpoints=sys.argv[1])
    child = os.fork()  # like a DataLoader worker: it shares the lock's open file
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
    """
)


@pytest.mark.processes
def test_a_killed_holders_children_still_hold_it_and_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_HOLDER, str(tmp_path / "ckpt")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # The child sleeps on: the wait for it to go runs out whatever its length, so a
        # short one says the same as the real 5 s.
        with monkeypatch.context() as patch:
            patch.setattr(folder_lock, "_LEFTOVER_WAIT_S", 0.5)
            with pytest.raises(gk.ConfigError, match=rf"left by pid {proc.pid} .* has ended"):
                gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt")
    finally:
        os.kill(child, signal.SIGKILL)
    for _ in range(3):  # the lock goes with the child (hold waits a moment for it)
        try:
            gk.Runtime(devices="cpu", checkpoints=tmp_path / "ckpt").teardown()
            break
        except gk.ConfigError:
            pass
    else:
        raise AssertionError("the lock outlived every process that held it")


def test_a_lock_record_the_disk_refuses_is_the_folders_error_with_its_errno(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk refuses the holder's record (root ignores chmod: the os call fails instead).
    def full(fd: int, data: bytes, offset: int) -> int:
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(gk.ConfigError) as caught:
        folder_lock.hold(tmp_path / "run", command="gpukit train", fix="unused")
    text = str(caught.value)
    assert text.startswith(f"{tmp_path / 'run'}: cannot write its lock file (No space left"), text
    assert "ENOSPC): give a folder you can write" in text, text
    assert not folder_lock.held_here(tmp_path / "run")
    assert not (tmp_path / "run").exists()  # the folder it made for the lock is removed again
