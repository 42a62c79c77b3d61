"""Views of a job as its launcher writes them into JOB/live.json, and a fake launcher that
publishes one: what `gpukit top` reads, made without a launcher that writes it."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from gpukit.launch.job_folders import PREFIX
from gpukit.watch.jobs import LIVE_FILE

GiB = 1024**3
STARTED = 1_790_000_000.0  # a fixed start, so that the times shown are the same every run


def gpu(index: int, *, throttle: list[str] | None = None, clock: int = 1980) -> dict[str, Any]:
    return {
        "index": index,
        "name": "NVIDIA H100",
        "util": 97,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "temp_c": 71,
        "sm_clock_mhz": clock,
        "max_sm_clock_mhz": 1980,
        "throttle": throttle or [],
        "other_processes": 0,
    }


def rank(number: int, step: int, *, slow: bool = False) -> dict[str, Any]:
    node, local = divmod(number, 2)
    step_s = 0.061 if slow else 0.052
    return {
        "rank": number,
        "node": node,
        "local_rank": local,
        "pid": 4000 + number,
        "alive": True,
        "step": step,
        "phase": "data" if slow else "backward",
        "where": "rt.backward at train.py:20",
        "beat_age_s": 0.1,
        "step_s": step_s,
        "step_s_median": step_s,
        "samples_per_s": 64 / step_s,
        "own_s": 0.061 if slow else 0.025,
        "shares": (
            {"data": 0.6, "coll": 0.0, "compute": 0.4}
            if slow
            else {"data": 0.05, "coll": 0.65, "compute": 0.3}
        ),
        "memory": {"allocated": 21 * GiB, "peak": 30 * GiB, "reserved": 32 * GiB, "rss": None},
        "gpu": gpu(local, throttle=["power cap"] if slow else [], clock=1410 if slow else 1980),
        "gpu_note": "",
    }


def straggler(step: int) -> dict[str, Any]:
    return {
        "time": STARTED + 30,
        "kind": "straggler",
        "attempt": 0,
        "step": step,
        "rank": 1,
        "node": 0,
        "host": "node-a",
        "slowdown": 2.4,
        "phase": "data",
        "text": "rank 1 (node 0, host node-a) is 2.4x slower than the median rank for 20 "
        "steps (own time 61 ms vs 25 ms per step), mostly in data (+36 ms per step); GPU 1: "
        "clocks throttled (power cap)",
    }


def two_nodes(step: int = 40, *, updated: float | None = None, **fields: Any) -> dict[str, Any]:
    """2 nodes x 2 ranks on GPUs: rank 1 a straggler, node 1 stale, a note that NVML is
    missing on node 1 (its ranks have no GPU readings)."""
    ranks = [rank(0, step), rank(1, step, slow=True), rank(2, step - 3), rank(3, step - 3)]
    for stale in ranks[2:]:
        stale["gpu"] = None
    view = {
        "version": 1,
        "name": "gpukit train",
        "command": ["gpukit", "train", "--workload", "gpt", "--nnodes", "2", "--devices", "2"],
        "host": "node-a",
        "launcher_pid": os.getpid(),
        "job_dir": "/tmp/gpukit-job-4242-x1y2z3",
        "out": "/runs/gpt",
        "node": 0,
        "nnodes": 2,
        "nproc": 2,
        "world_size": 4,
        "attempt": 0,
        "restarts": 1,
        "started": STARTED,
        "updated": STARTED + 40 if updated is None else updated,
        "ended": None,
        "step": step - 3,
        "total_steps": 200,
        "samples_per_s": 4 * 1049.2,
        "eta_s": 131.0,
        "checkpoint": {"step": 30, "path": "/runs/gpt/checkpoints/step-000030"},
        "ranks": ranks,
        "nodes": [
            {"node": 0, "host": "node-a", "age_s": 0.2, "stale": False, "note": ""},
            {"node": 1, "host": "node-b", "age_s": 12.3, "stale": True, "note": "no post"},
        ],
        "stragglers": [straggler(step)],
        "events": [
            {
                "time": STARTED + 12,
                "kind": "restart",
                "attempt": 0,
                "step": 10,
                "rank": 3,
                "text": "restart 1 of 3: rank 3 exited with code 1",
            },
            straggler(step),
        ],
        "notes": [
            "node 1 (node-b): NVML: not installed (pip install nvidia-ml-py): no GPU readings"
        ],
    }
    view.update(fields)
    return view


def job_folder(where: Path, pid: int | None = None) -> Path:
    """A folder named as a launcher of pid ``pid`` (default: this process, alive) names its."""
    folder = where / f"{PREFIX}{os.getpid() if pid is None else pid}-fake"
    folder.mkdir(parents=True)
    return folder


def publish(folder: Path, view: dict[str, Any]) -> None:
    """Write ``view`` as the launcher does: whole, then renamed over the old one."""
    partial = folder / f".{LIVE_FILE}.partial"
    partial.write_text(json.dumps(view))
    os.replace(partial, folder / LIVE_FILE)


class Publisher:
    """A launcher's view, rewritten every ``period`` seconds with the steps growing, from a
    thread of the test's process, until the block ends or the step ``ends_at`` (whose view
    says the job ended)."""

    def __init__(self, folder: Path, period: float = 0.2, ends_at: int | None = None) -> None:
        self.folder = folder
        self.period = period
        self.ends_at = ends_at
        self.step = 40
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Publisher:
        publish(self.folder, self.view())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def view(self) -> dict[str, Any]:
        now = time.time()
        view = two_nodes(self.step, updated=now)
        if self.step == self.ends_at:
            view["ended"] = {"time": now, "code": 0, "how": "finished"}
        return view

    def _run(self) -> None:
        while self.step != self.ends_at and not self._done.wait(self.period):
            self.step += 1
            publish(self.folder, self.view())
