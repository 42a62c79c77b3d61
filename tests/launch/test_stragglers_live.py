"""Stragglers named by a real launcher: 2 gloo ranks of a gpukit Runtime, one of them slow
(its data loading sleeps, or a CPU-bound process shares its core), and the job's live.json and
events; then one job over two nodes' launchers, whose live.json holds every node's ranks."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpukit.launch import run_job
from gpukit.launch.job_records import EVENTS_FILE, LIVE_FILE
from gpukit.launch.ports import free_port
from gpukit.launch.restarts import ATTEMPTS_FILE

# The straggler tests time ranks against each other: one at a time ("timing"); the view of
# every node times nothing and runs beside the others.
pytestmark = pytest.mark.processes

SRC = str(Path(__file__).resolve().parents[2] / "src")

# argv: mode ("sleep": rank 1's samples take 10 ms each; "pin": rank r runs on core r), steps.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import gpukit as gk

    mode, steps = sys.argv[1], int(sys.argv[2])
    rank = int(os.environ["RANK"])
    if mode == "pin":
        os.sched_setaffinity(0, {rank % os.cpu_count()})

    class Samples(Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            if mode == "sleep" and rank == 1:
                time.sleep(0.01)
            return torch.full((32,), float(i % 7)), torch.ones(1)

    rt = gk.Runtime(seed=0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt, loader = rt.setup(model, opt, DataLoader(Samples(), batch_size=2))
    work = torch.randn(256, 256) / 16
    for x, y in loader:
        if mode == "pin":
            for _ in range(16):  # CPU-bound work of the rank's own, ~20 ms
                work = torch.tanh(work @ work)
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(opt)
        if rt.global_step >= steps:
            break
    rt.teardown()
    """
)


def _job(tmp_path: Path, mode: str, steps: int) -> tuple[int, str, Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "job"
    out = io.StringIO()
    code = run_job(
        [sys.executable, str(script), mode, str(steps)],
        2,
        out=out,
        job_dir=folder,
        env={"PYTHONPATH": SRC},
        name="gpukit launch",
    )
    return code, out.getvalue(), folder


def _events(folder: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (folder / EVENTS_FILE).read_text().splitlines()]


def _time_to_detection(folder: Path, event: dict[str, object]) -> float:
    attempt = json.loads((folder / ATTEMPTS_FILE).read_text().splitlines()[0])
    return float(event["time"]) - float(attempt["first_step"])  # type: ignore[arg-type]


@pytest.mark.xdist_group("timing")
def test_a_rank_slow_in_its_data_is_named_with_the_phase(tmp_path: Path) -> None:
    code, said, folder = _job(tmp_path, "sleep", 200)
    assert code == 0, said
    lines = [line for line in said.splitlines() if "straggler: rank" in line]
    assert lines and lines[0].startswith("gpukit launch: straggler: rank 1 (node 0, host "), said
    live = json.loads((folder / LIVE_FILE).read_text())
    assert [r["rank"] for r in live["ranks"]] == [0, 1]
    assert live["ended"]["code"] == 0 and live["world_size"] == 2
    # Where the loader's fetch is beaten ("data"), it is named; before it is, the time to
    # fetch lies in the user's code between steps ("loop").
    fetched = any(r["phases_s"] and r["phases_s"]["data"] > 0 for r in live["ranks"])
    phase = "data" if fetched else "loop"
    assert f"mostly in {phase} (+" in lines[0]
    named = [e for e in _events(folder) if e["kind"] == "straggler"]
    assert named[0]["rank"] == 1 and named[0]["phase"] == phase
    assert _events(folder)[-1]["kind"] == "ended"
    print(f"\ntime to detection (data, 10 ms/sample): {_time_to_detection(folder, named[0]):.2f} s")
    print(lines[0])


@pytest.mark.xdist_group("timing")
def test_a_rank_sharing_its_core_with_a_busy_process_is_named(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores to pin the ranks to")
    # Each competitor in a session of its own: the kernel shares a core between sessions
    # (autogroups) before processes, so three sessions on core 1 leave rank 1 a quarter of
    # it, whatever else runs on the machine.
    busy = [
        subprocess.Popen(
            [sys.executable, "-c", "import os; os.sched_setaffinity(0, {1})\nwhile True: pass"],
            executable=sys.executable,
            start_new_session=True,
        )
        for _ in range(3)
    ]
    try:
        code, said, folder = _job(tmp_path, "pin", 100)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    assert code == 0, said
    named = [e for e in _events(folder) if e["kind"] == "straggler" and e["rank"] == 1]
    if not named:
        # On a machine whose other load moves freely between its cores, the scheduler evens
        # it out: core 0 gets as busy as core 1 and rank 1 is no slower than rank 0. Then
        # there is no straggler to name; what the ranks' own times were says so.
        own = [r["own_s"] for r in json.loads((folder / LIVE_FILE).read_text())["ranks"]]
        if own[1] is not None and own[0] and own[1] < 1.2 * own[0]:
            pytest.skip(f"the busy process did not slow rank 1 here (own times {own})")
    assert named, said
    print(f"\ntime to detection (core shared): {_time_to_detection(folder, named[0]):.2f} s")
    print(named[0]["text"])


NODE = textwrap.dedent(
    """
    import sys
    from gpukit.launch import Nodes, run_job
    node, port, folder, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    nodes = Nodes(2, 2, node, "127.0.0.1", port)
    sys.exit(run_job([sys.executable, script, "sleep", "60"], 2, nodes=nodes, job_dir=folder))
    """
)


def test_every_node_lists_every_rank_of_the_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GPUKIT_JOB_DIR"):
        env.pop(name, None)
    nodes = [
        subprocess.Popen(
            [sys.executable, "-c", NODE, str(n), str(port), str(tmp_path / f"job{n}"), script],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    outputs = [n.communicate(timeout=300)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs
    for n in range(2):
        live = json.loads((tmp_path / f"job{n}" / LIVE_FILE).read_text())
        ranks = [(r["rank"], r["node"]) for r in live["ranks"]]
        assert ranks == [(0, 0), (1, 0), (2, 1), (3, 1)], (n, live)
        assert live["node"] == n and live["nnodes"] == 2
