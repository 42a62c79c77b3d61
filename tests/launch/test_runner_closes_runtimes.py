"""A script under gpukit's launcher that never calls ``rt.teardown()`` still leaves its process
group before the interpreter shuts down (where gloo's threads would abort the process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch
    import torch.distributed as dist
    import gpukit as gk

    # Runs at interpreter exit: by then the runner has torn the Runtime down.
    atexit.register(lambda: print(f"at exit: group open={dist.is_initialized()}", flush=True))
    rt = gk.Runtime(strategy="ddp", devices="auto")
    model = torch.nn.Linear(4, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = model(torch.ones(3, 4)).sum()
    rt.backward(loss)
    optimizer.step()
    print(f"rank {rt.rank} done, group open={dist.is_initialized()}", flush=True)
    if sys.argv[1:] == ["exit"]:
        sys.exit(0)
    """
)


@pytest.mark.processes
@pytest.mark.parametrize("ending", ["return", "exit"])
def test_a_runtime_left_open_is_torn_down_when_the_script_ends(tmp_path: Path, ending: str) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", "train.py", ending]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done, group open=True") == 2, done.stdout
    assert done.stdout.count("at exit: group open=False") == 2, done.stdout
    assert "terminate called" not in done.stderr
