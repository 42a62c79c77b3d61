"""`gpukit top` on a real job, as a person uses it: `gpukit launch` runs 2 gloo ranks of a
torchrun-style script whose rank 1 loads its data slowly, and `gpukit top`, with no option, finds
that job by itself, shows both ranks stepping and the straggler named in its header, quits on
q and leaves the job untouched; `gpukit top --json` follows the same job line by line."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from gpukit.launch.job_folders import PREFIX
from gpukit.watch.jobs import LIVE_FILE
from tests.watch.terminals import tmux_pane

pytestmark = [
    pytest.mark.processes,
    pytest.mark.xdist_group("timing"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEPS = 300

# Rank 1's samples take 4 ms each to load: its steps wait on its loader, rank 0's on rank 1.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import gpukit as gk

    steps, rank = int(sys.argv[1]), int(os.environ["RANK"])

    class Samples(Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            if rank == 1:
                time.sleep(0.004)
            return torch.full((32,), float(i % 7)), torch.ones(1)

    rt = gk.Runtime(seed=0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, loader = rt.setup(model, opt, DataLoader(Samples(), batch_size=4))
    for x, y in loader:
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
        if rt.global_step >= steps:
            break
    rt.teardown()
    """
)
# A rank's row on the screen: node, rank (" slow" when it straggles), step.
RANK_ROW = re.compile(r"^\s*0\s+(\d)(?: slow)?\s+(\d+)\s", re.MULTILINE)


def _environment(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": SRC, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPUKIT_JOB_DIR", "GPUKIT_FAULT"):
        env.pop(name, None)
    return env


def _launch(tmp_path: Path) -> subprocess.Popen[str]:
    """The job, started as a user starts it, once its view is written."""
    (tmp_path / "train.py").write_text(SCRIPT)
    command = [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", "train.py", str(STEPS)]
    job = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=_environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(f"{PREFIX}*/{LIVE_FILE}")):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"the launcher wrote no live.json:\n{job.communicate()[0]}")
        time.sleep(0.1)
    return job


def _steps(screen: str) -> dict[int, int]:
    return {int(rank): int(step) for rank, step in RANK_ROW.findall(screen)}


def _time_to_detection(views: list[dict[str, Any]]) -> float:
    """About how long after the job's first step the straggler was named, from the views
    --json printed (the job's folder, with its attempts' records, is gone at its end): the
    first step's time is the first view's with steps, less those steps at their median."""
    stepping = next(v for v in views if v["step"] and v["step"] > 0)
    slowest = max(stepping["ranks"], key=lambda r: r["step_s_median"] or 0)
    first_step = stepping["updated"] - stepping["step"] * (slowest["step_s_median"] or 0)
    named = next(e for v in views for e in v["events"] if e["kind"] == "straggler")
    return float(named["time"]) - first_step


def test_top_watches_a_real_job_names_its_straggler_and_quits_leaving_it_alone(
    tmp_path: Path,
) -> None:
    job = _launch(tmp_path)
    # --json on the same job, from its start to its end: one parsable view per line.
    follow = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "top", "--json", "--interval", "0.5"],
        env=_environment(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        env = " ".join(
            f"{k}={shlex.quote(v)}"
            for k, v in _environment(tmp_path).items()
            if k in ("PYTHONPATH", "TMPDIR", "OMP_NUM_THREADS")
        )
        top = shlex.join([sys.executable, "-m", "gpukit", "top", "--interval", "0.3"])
        with tmux_pane(width=220, height=50) as pane:
            pane.type(f"env {env} {top}; echo $? > {tmp_path / 'code'}", "Enter")
            pane.wait_for("both ranks", lambda: len(_steps(pane.screen())) == 2)
            first = _steps(pane.screen())
            pane.wait_for(
                "both ranks to step on",
                lambda: all(s > first[r] for r, s in _steps(pane.screen()).items()),
            )
            pane.wait_for(
                "the straggler in the header",
                lambda: "stragglers: rank 1 (node 0, " in pane.screen(),
            )
            screen = pane.screen()
            assert re.search(
                r"stragglers: rank 1 \(node 0, [^)]+\) [\d.]+x slower, mostly in "
                r"data",
                screen,
            ), screen
            assert re.search(r"^\s*0\s+1 slow\s+\d+", screen, re.MULTILINE), screen
            pane.type("q")
            pane.wait_for("top to quit", (tmp_path / "code").exists)
            assert (tmp_path / "code").read_text().strip() == "0"
            assert job.poll() is None, "the job ended before top quit: too short to watch"
            assert "Traceback" not in pane.screen()
        said, _ = job.communicate(timeout=240)
        assert job.returncode == 0, said
        lines, ended = follow.communicate(timeout=60)
    finally:
        for process in (job, follow):
            if process.poll() is None:
                process.kill()
                process.communicate()
    assert "gpukit launch: straggler: rank 1 (node 0, host " in said, said
    assert follow.returncode == 0
    # The launcher removes its folder as it ends: --json's last line may precede the end,
    # which it says on stderr.
    assert "gpukit top: the job ended" in ended, ended
    views = [json.loads(line) for line in lines.splitlines()]
    assert len(views) >= 2
    for view in views:
        assert all(isinstance(r["rank"], int) and isinstance(r["step"], int) for r in view["ranks"])
    assert {r["rank"] for r in views[-1]["ranks"]} == {0, 1}
    assert views[-1]["step"] >= views[0]["step"]
    print(f"\ntime to detection (4 ms/sample on rank 1): about {_time_to_detection(views):.1f} s")
    print(next(line for line in said.splitlines() if "straggler: rank" in line))
