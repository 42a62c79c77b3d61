"""Profiles of a window of steps (rt.profile, StepProfile): the Chrome/Perfetto JSON read back,
its step markers, the summary table, the steps counted, files per rank, bad requests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit.diagnostics.profiles import StepProfile
from gpukit.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")
DDP2 = {"strategy": "ddp", "devices": ["cpu", "cpu"], "seed": 0}


def _events(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    return events


def _step_marks(path: Path) -> list[str]:
    return sorted(
        {e["name"] for e in _events(path) if e.get("name", "").startswith("ProfilerStep#")}
    )


def _train(rt: gk.Runtime, steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        loss = model(torch.randn(6, 4)).pow(2).mean()
        rt.backward(loss)
        rt.step(opt)


def test_rt_profile_writes_the_window_of_runtime_steps(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu", accumulate=2)
    model = torch.nn.Linear(4, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rt.backward(model(torch.ones(2, 4)).mean())
    rt.step(opt)
    rt.backward(model(torch.ones(2, 4)).mean())
    rt.step(opt)  # global step 1 before the profile
    with rt.profile(tmp_path / "prof", wait=1, warmup=1, active=3) as prof:
        for _ in range(2 * 6):  # 6 optimizer steps, each of 2 micro-batches
            rt.backward(model(torch.ones(2, 4)).mean())
            rt.step(opt)
    assert prof.steps == 6  # the Runtime's steps, not its micro-batches
    assert [(w.first, w.last, w.rank) for w in prof.windows] == [(4, 6, 0)]
    path = tmp_path / "prof" / "gpukit_rank0.6.pt.trace.json"
    assert prof.files == [path]
    marks = _step_marks(path)
    assert len(marks) == 3  # the three active steps, each a ProfilerStep
    names = {e.get("name") for e in _events(path)}
    assert "aten::addmm" in names
    table = (tmp_path / "prof" / "gpukit_rank0.6.summary.txt").read_text()
    assert "Self CPU" in table and "ProfilerStep" in table and "aten::addmm" in table
    assert table.strip() == prof.windows[0].table.strip()
    report = prof.report()
    assert report.startswith(f"Profile of steps 4-6 (rank 0): {path}") and "Self CPU" in report


def test_rt_profile_counts_train_step_and_repeats_windows(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    model = torch.nn.Linear(3, 1)
    model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (torch.ones(4, 3), torch.zeros(4, 1))
    mse = torch.nn.functional.mse_loss
    with rt.profile(tmp_path, wait=0, warmup=1, active=1, repeat=2) as prof:
        for _ in range(5):
            rt.train_step(opt, batch, lambda b: mse(model(b[0]), b[1]))
    assert [(w.first, w.last) for w in prof.windows] == [(2, 2), (4, 4)]
    assert [p.name for p in prof.files] == [
        "gpukit_rank0.2.pt.trace.json",
        "gpukit_rank0.4.pt.trace.json",
    ]
    assert all(len(_step_marks(p)) == 1 for p in prof.files)


def test_steps_of_another_runtime_or_plain_optimizers_do_not_count(tmp_path: Path) -> None:
    rt, other = gk.Runtime(devices="cpu"), gk.Runtime(devices="cpu")
    p = torch.nn.Parameter(torch.ones(2))
    plain = torch.optim.SGD([p], lr=0.1)
    with rt.profile(tmp_path) as prof:
        _train(other, 2)
        for _ in range(2):
            p.sum().backward()
            plain.step()
    assert prof.steps == 0 and prof.windows == []
    assert prof.report().startswith(
        "Profile: nothing written: 0 steps ran, the window was steps 3-5"
    )


def test_optimizer_steps_count_the_first_optimizer_only(tmp_path: Path) -> None:
    g, d = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt_g, opt_d = torch.optim.SGD([g], lr=0.1), torch.optim.SGD([d], lr=0.1)
    with StepProfile(tmp_path, wait=1, warmup=1, active=2, steps="optimizer") as prof:
        for _ in range(5):  # a GAN's iteration: two optimizers step
            (g.sum() + d.sum()).backward()
            opt_g.step()
            opt_d.step()
    assert prof.steps == 5
    assert [(w.first, w.last) for w in prof.windows] == [(3, 4)]
    assert len(_step_marks(prof.files[0])) == 2


def test_auto_counts_a_runtime_step_once(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    with StepProfile(tmp_path, wait=1, warmup=1, active=2) as prof:  # steps="auto"
        _train(rt, 5)
    assert prof.steps == 5 and rt.global_step == 5
    assert [(w.first, w.last) for w in prof.windows] == [(3, 4)]


def test_a_window_the_program_ends_inside_is_written_with_its_steps(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    with rt.profile(tmp_path, wait=1, warmup=1, active=5) as prof:
        _train(rt, 4)
    assert [(w.first, w.last) for w in prof.windows] == [(3, 4)]
    assert _step_marks(prof.files[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"active": 0}, "active=0"),
        ({"wait": -1}, "wait=-1"),
        ({"warmup": 1.5}, "warmup=1.5"),
        ({"repeat": True}, "repeat=True"),
        ({"steps": "epochs"}, "steps='epochs'"),
    ],
)
def test_bad_windows_say_what_is_allowed(tmp_path: Path, bad: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        StepProfile(tmp_path, **bad)


def test_a_file_is_not_a_profile_folder(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        gk.Runtime(devices="cpu").profile(tmp_path / "f")


def _profiled_ranks(rt: gk.Runtime, folder: str) -> list[tuple[int, int, int]]:
    with rt.profile(folder, wait=1, warmup=1, active=2) as prof:
        _train(rt, 5)
    return [(w.first, w.last, w.rank) for w in prof.windows]


@pytest.mark.processes
def test_each_rank_writes_its_own_file(tmp_path: Path) -> None:
    rt = gk.Runtime(**DDP2)
    assert rt.launch(_profiled_ranks, str(tmp_path)) == [(3, 4, 0)]
    for rank in (0, 1):
        path = tmp_path / f"gpukit_rank{rank}.4.pt.trace.json"
        assert len(_step_marks(path)) == 2
        assert "Self CPU" in (tmp_path / f"gpukit_rank{rank}.4.summary.txt").read_text()
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 2


# -- one profiler at a time: two crash the process, so each case runs in a process of its own ----
LOOP = """
import sys, tempfile, torch, gpukit as gk
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def steps(n, rt=None):
    for _ in range(n):
        loss = model(torch.ones(4, 2)).mean()
        if rt is None:
            loss.backward(); opt.step(); opt.zero_grad()
        else:
            rt.backward(loss); rt.step(opt)
"""

NESTED = """
rt = gk.Runtime(devices="cpu")
model, opt = rt.setup(model, opt)
with rt.profile(tempfile.mkdtemp(), wait=0, warmup=0, active=2):
    with rt.profile(tempfile.mkdtemp(), wait=0, warmup=0, active=2):
        steps(5, rt)
"""

INSIDE_TORCH = """
rt = gk.Runtime(devices="cpu")
model, opt = rt.setup(model, opt)
with torch.profiler.profile():
    with rt.profile(tempfile.mkdtemp(), wait=0, warmup=0, active=2):
        steps(5, rt)
"""

# The script profiles each step itself, as some training scripts do.
PROFILES_ITSELF = """
for _ in range(6):
    with torch.profiler.profile():
        steps(1)
"""


def _python(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.processes
@pytest.mark.parametrize(
    ("body", "said"),
    [
        pytest.param(
            NESTED, r"ConfigError: a profile of .* started inside the profile of", id="rt-in-rt"
        ),
        pytest.param(
            INSIDE_TORCH,
            r"ConfigError: profile of .*: another profiler is already recording",
            id="rt-in-torch",
        ),
    ],
)
def test_a_second_profile_is_refused_not_a_segfault(tmp_path: Path, body: str, said: str) -> None:
    (tmp_path / "two.py").write_text(LOOP + body)
    done = _python(tmp_path, "two.py")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert re.search(said, done.stderr), done.stderr[-2000:]
    assert "two profilers at once crash the process" in done.stderr


@pytest.mark.processes
def test_trace_profile_over_a_script_that_profiles_refuses_the_scripts_profiler(
    tmp_path: Path,
) -> None:
    (tmp_path / "profiles.py").write_text(LOOP + PROFILES_ITSELF)
    args = ["-m", "gpukit", "trace", "--profile", "prof", "--profile-window", "0,0,3"]
    done = _python(tmp_path, *args, "profiles.py")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "the traced program failed (at profiles.py:" in done.stderr
    assert "torch.profiler.profiler.profile started while a gpukit profile records" in done.stderr
    alone = _python(tmp_path, "-m", "gpukit", "trace", "profiles.py")  # without --profile: runs
    assert alone.returncode == 0, alone.stderr[-2000:]


def test_torch_profilers_start_again_once_the_profile_ends(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    refused = pytest.raises(ConfigError, match="started while a gpukit profile records")
    with rt.profile(tmp_path, wait=1, warmup=0, active=1), refused:
        torch.profiler.profile().__enter__()
    with torch.profiler.profile() as prof:  # the guard is gone with the profile
        torch.ones(2).sum()
    assert prof.key_averages()
