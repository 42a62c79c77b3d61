"""The training runtime's whole-program example runs as written, in 1 and 2 processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "training-runtime.md"

pytestmark = pytest.mark.processes


def _training_example() -> str:
    text = PAGE.read_text()
    start = text.index("One loop for one CPU, one GPU, or one process per device under DDP:")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block, "the Training runtime section lost its example"
    return block.group(1)


def _run(folder: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.parametrize("processes", [1, 2])
def test_the_training_runtime_example_runs_as_written(tmp_path: Path, processes: int) -> None:
    source = _training_example()
    if processes == 2:  # the one change a user makes to train in two CPU processes
        assert 'devices="auto"' in source
        source = source.replace('devices="auto"', "devices=2")
    (tmp_path / "train.py").write_text(source)
    done = _run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if line.startswith("{'step'")]
    # rank 0 printed the last window's record once: 10 epochs of 1024/64/processes steps
    assert len(printed) == 1 and f"'step': {10 * 16 // processes}," in printed[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step-{160 // processes:08d}"


def test_the_training_runtime_example_runs_under_gpukit_launch(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_training_example())
    done = _run(tmp_path, sys.executable, "-m", "gpukit", "launch", "--nproc", "2", "train.py")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if "{'step'" in line]
    assert len(printed) == 1 and "'step': 80," in printed[0]
