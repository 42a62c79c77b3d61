"""rt.launch's ranks under gpukit launch's supervisor: a hang named with its rank and line, the
first failure named first, restarts that resume exactly, and its options refused when wrong."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.errors import ConfigError, LaunchError

STEPS = 6


def _train(rt: gk.Runtime, folder: str, hang_at: int = -1, raise_at: int = -1) -> dict[str, Any]:
    """A small DDP run of ``STEPS`` steps; rank 1 hangs or raises when it reaches ``hang_at``
    or ``raise_at`` steps done."""
    Path(folder, f"attempt-{os.environ.get('GPUKIT_ATTEMPT')}-rank-{rt.rank}").touch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model, optimizer, loader = rt.setup(model, torch.optim.AdamW(model.parameters()), loader)
    while rt.global_step < STEPS:
        for x, y in loader:
            if rt.rank == 1 and rt.global_step == hang_at:
                for _ in range(600):  # bounded: a regression must not stall the suite
                    time.sleep(0.5)  # hangs here
            if rt.rank == 1 and rt.global_step == raise_at and os.environ["GPUKIT_ATTEMPT"] == "0":
                raise ValueError(f"boom at step {raise_at}")
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
            if rt.global_step >= STEPS:
                break
    return {k: v.detach().clone() for k, v in rt.unwrap(model).state_dict().items()}


def _line_of(marker: str) -> int:
    lines, start = inspect.getsourcelines(_train)
    return start + next(i for i, text in enumerate(lines) if marker in text)


@pytest.mark.processes
@pytest.mark.xdist_group("timing")
def test_a_hung_rank_is_named_with_its_line(tmp_path: Path) -> None:
    # No normal stretch between two beats may come near hang_timeout, even on a loaded
    # machine: a nested function runs in ranks forked from this process, which has imported
    # what a rank imports by running the same function once (a new interpreter spends seconds
    # importing torch, and so would a forked rank importing the rest).
    def hangs(rt: gk.Runtime, folder: str) -> dict[str, Any]:
        return _train(rt, folder, hang_at=2)

    gk.Runtime(devices="cpu").launch(_train, str(tmp_path))
    with pytest.raises(LaunchError) as err:
        gk.Runtime(devices=2).launch(hangs, str(tmp_path), hang_timeout=5)
    text = str(err.value)
    line = _line_of("# hangs here")
    assert text.startswith("rank 1 hung at step 2"), text
    assert f"test_rt_launch_supervised.py:{line} in _train" in text.splitlines()[0], text
    assert "no heartbeat for 5 s (hang_timeout)" in text, text


@pytest.mark.processes
def test_the_first_failure_is_named_first(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as err:
        gk.Runtime(devices=2).launch(_train, str(tmp_path), -1, 2)
    text = str(err.value)
    assert text.startswith("rank 1 failed:"), text
    head = text.splitlines()[1]
    assert re.match(r"rt\.launch: rank 1 raised ValueError: boom at step 2 .*— the first", head)
    assert "; rank 0 " in head, head  # the other rank comes after it, whatever it did
    assert "Traceback" in text and 'raise ValueError(f"boom at step {raise_at}")' in text
    assert not (tmp_path / "attempt-1-rank-0").exists()  # not restarted: none were asked for


@pytest.mark.processes
def test_a_restart_resumes_from_the_checkpoint_to_the_same_result(tmp_path: Path) -> None:
    def runtime(folder: str) -> gk.Runtime:
        checkpoints = tmp_path / folder / "ck"
        return gk.Runtime(devices=2, seed=0, checkpoints=checkpoints, save_every=2, resume="auto")

    (tmp_path / "straight").mkdir()
    (tmp_path / "restarted").mkdir()
    straight = runtime("straight").launch(_train, str(tmp_path / "straight"))
    restarted = runtime("restarted").launch(
        _train, str(tmp_path / "restarted"), -1, 3, max_restarts=1
    )
    assert (tmp_path / "restarted" / "attempt-1-rank-0").exists()  # it was restarted
    assert not (tmp_path / "straight" / "attempt-1-rank-0").exists()
    assert straight.keys() == restarted.keys()
    for name, tensor in straight.items():
        assert torch.equal(tensor, restarted[name]), name


def _nothing(rt: gk.Runtime) -> None:
    return None


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_a_bad_max_restarts_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"rt\.launch\(max_restarts=.*\): give a whole number"):
        gk.Runtime(devices="cpu").launch(_nothing, max_restarts=value)


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "30"])
def test_a_bad_hang_timeout_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"rt\.launch\(hang_timeout=.*\): give seconds"):
        gk.Runtime(devices="cpu").launch(_nothing, hang_timeout=value)


def test_good_options_run_fn_in_place() -> None:
    assert gk.Runtime(devices="cpu").launch(lambda rt, x: x + 1, 1, max_restarts=2) == 2
    assert gk.Runtime(devices="cpu").launch(_nothing, hang_timeout=None) is None


ORPHAN = """
import os, sys, time
import gpukit as gk

def wait(rt, folder):
    aside = os.path.join(folder, f"tmp-{rt.rank}")
    with open(aside, "w") as file:
        file.write(str(os.getpid()))
    os.replace(aside, os.path.join(folder, f"pid-{rt.rank}"))  # the test reads it whole
    for _ in range(1200):
        time.sleep(0.1)

if __name__ == "__main__":
    try:
        gk.Runtime(devices=2).launch(wait, sys.argv[1])
    except KeyboardInterrupt:
        sys.exit(7)
"""


def _start_waiting(folder: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The program above, once both its ranks run; their process ids."""
    (folder / "orphan.py").write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": str(Path(gk.__file__).parents[1])}
    parent = subprocess.Popen([sys.executable, "orphan.py", str(folder)], cwd=folder, env=env)
    deadline = time.monotonic() + 240  # a hang guard only
    while not all((folder / f"pid-{r}").exists() for r in (0, 1)):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()
            pytest.fail(f"the ranks did not start (exit {parent.wait()})")
        time.sleep(0.1)
    # Each id file appears whole (written aside, then renamed): no wait for the writes.
    return parent, [int((folder / f"pid-{r}").read_text()) for r in (0, 1)]


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(pid) for pid in pids)


@pytest.mark.processes
@pytest.mark.cold_start
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_die_with_the_calling_process(tmp_path: Path) -> None:
    parent, pids = _start_waiting(tmp_path)
    parent.kill()  # SIGKILL: no handler of its own can stop the ranks
    parent.wait()
    assert _gone(pids)


@pytest.mark.processes
@pytest.mark.xdist_group("timing")
def test_a_ctrl_c_with_nothing_to_save_raises_keyboard_interrupt(tmp_path: Path) -> None:
    parent, pids = _start_waiting(tmp_path)
    parent.send_signal(signal.SIGINT)
    assert parent.wait(timeout=120) == 7  # the program caught KeyboardInterrupt
    assert _gone(pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
