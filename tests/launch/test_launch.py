"""rt.launch from where a function cannot be imported by a new interpreter: `python -c`, a
notebook; and how the start method is chosen."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit.errors import LaunchError
from gpukit.launch import start_methods as launch

# Uses the CPU's thread pool before launching (OpenMP's threads do not survive a fork, and a
# forked rank that waited for them would hang), then trains 2 gloo ranks.
PROGRAM = """
import torch, gpukit as gk

a = torch.randn(512, 512)
(a @ a).sum()

def train(rt, scale):
    model = torch.nn.Linear(64, 1)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 64)
    mse = torch.nn.functional.mse_loss
    for _ in range(2):
        rt.train_step(optimizer, (x, x.sum(1, keepdim=True)), lambda b: mse(model(b[0]), b[1]))
    (x @ x.T).sum()
    total = rt.all_reduce(torch.tensor([float(rt.rank + 1)]), op="sum")
    return f"world {rt.world_size} rank {rt.rank} sum {total.item() * scale:g}"

print(gk.Runtime(devices=2).launch(train, 10))
"""


def run_python(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only
        check=False,
    )


@pytest.mark.processes
def test_launch_from_python_c_returns_rank_zeros_result() -> None:
    done = run_python("-c", PROGRAM)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "world 2 rank 0 sum 30"


@pytest.mark.processes
def test_launch_of_a_function_defined_in_a_notebook_cell(tmp_path: Path) -> None:
    # As IPython runs a notebook: cells execute in a __main__ module that has no file.
    runner = tmp_path / "kernel.py"
    runner.write_text(
        textwrap.dedent(
            """
            import sys, types
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(sys.stdin.read(), "<cell>", "exec"), main.__dict__)
            """
        )
    )
    done = run_python(str(runner), stdin=PROGRAM)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "world 2 rank 0 sum 30"


def importable(rt: object) -> int:
    return 0


@pytest.fixture
def fileless_main(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A __main__ as python -c or a notebook has it (no __file__), holding a function ``f``."""
    main = types.ModuleType("__main__")
    exec("def f(rt):\n    return rt.rank\n", main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", main)
    return main


def test_an_importable_function_is_spawned() -> None:
    assert launch.start_method(importable, (importable, ())) == "spawn"


def test_a_function_in_a_fileless_main_is_forked(fileless_main: types.ModuleType) -> None:
    assert launch.start_method(fileless_main.f, (fileless_main.f, ())) == "fork"
    # The same function from a __main__ with a file is spawned: that file is imported again.
    fileless_main.__file__ = "/somewhere/train.py"
    assert launch.start_method(fileless_main.f, (fileless_main.f, ())) == "spawn"


def test_arguments_that_cannot_be_pickled_are_forked() -> None:
    assert launch.start_method(importable, (importable, (lambda: 1,))) == "fork"


def test_after_cuda_is_initialised_it_says_why_and_what_to_do(
    fileless_main: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchError) as err:
        gk.Runtime(devices=2).launch(fileless_main.f)
    text = str(err.value)
    assert text.startswith("rt.launch(f): f is defined in __main__ of a program without a file")
    assert "CUDA is already initialised in this process" in text
    assert "define f at the top level of a .py file" in text and "gpukit launch" in text


def test_without_fork_it_says_why_and_what_to_do(
    fileless_main: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch.mp, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(LaunchError, match=r"this platform cannot fork: define f at the top"):
        gk.Runtime(devices=2).launch(fileless_main.f)


def exits_on_rank_one(rt: gk.Runtime) -> None:
    if rt.rank == 1:
        os._exit(3)
    for _ in range(1200):  # no collective, which would fail by itself: rank 0 is stopped
        time.sleep(0.1)


@pytest.mark.processes
def test_a_rank_that_exits_without_an_error_is_not_called_out_of_memory() -> None:
    with pytest.raises(LaunchError) as err:
        gk.Runtime(devices=2).launch(exits_on_rank_one)
    text = str(err.value)
    assert text.startswith("rank 1 exited with code 3 before finishing, without a Python error")
    assert "memory" not in text


def test_the_launchers_lines_reach_the_stream_in_one_write() -> None:
    """Ranks write to the same terminal or pipe as the launcher: a line the launcher writes in
    two pieces (``print`` of text holding newlines writes the final newline apart) can have a
    rank's output land inside it, a folder's name among them."""
    from gpukit.launch.job import _say

    class Writes:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out = Writes()
    settings = types.SimpleNamespace(out=out)
    lines = ["report\n  rank 0 waits", "  kept in /tmp/gpukit-job-1-ab"]
    _say(settings, lines)  # type: ignore[arg-type]
    assert out.writes == ["report\n  rank 0 waits\n  kept in /tmp/gpukit-job-1-ab\n"]
