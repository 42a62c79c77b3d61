"""Run folders as ``gpukit train --out DIR`` under gpukit's launcher leaves them: metrics.json,
metrics.csv, config.toml, and the launcher's ranks.jsonl and events.jsonl (written here from
their schema), for two ranks of a job that restarted once, had a straggler and a hang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

START = 1_700_000_000.0
MiB = 2**20
HANG_REPORT = """hang: no heartbeat from rank 1 for 30 s
rank 1 (pid 4242) at step 37, phase backward:
  File "train.py", line 20, in main
    rt.backward(loss)"""


def rank(r: int, step: int, *, slow: bool = False, cpu: bool = False) -> dict[str, Any]:
    """One RANK record of a ranks.jsonl sample (spec: without "where" and "gpu_note")."""
    own = 0.061 if slow else 0.025
    memory = (
        {"allocated": None, "peak": None, "reserved": None, "rss": (300 + r) * MiB}
        if cpu
        else {
            "allocated": (100 + 10 * r) * MiB,
            "peak": (150 + 10 * r) * MiB,
            "reserved": (200 + 10 * r) * MiB,
            "rss": None,
        }
    )
    return {
        "rank": r,
        "node": 0,
        "local_rank": r,
        "pid": 4000 + r,
        "alive": True,
        "step": step,
        "phase": "forward",
        "beat_age_s": 0.1,
        "step_s": own + 0.02,
        "step_s_median": own + 0.02,
        "samples_per_s": 32 / (own + 0.02),
        "own_s": own,
        "shares": {
            "data": 0.5 if slow else 0.1,
            "coll": 0.0 if slow else 0.3,
            "compute": 0.5 if slow else 0.6,
        },
        "memory": memory,
        "gpu": None,
    }


def events() -> list[dict[str, Any]]:
    """A restart with its cause, a straggler and its recovery, a hang with its report, the
    end."""
    common = {"node": 0, "host": "h", "slowdown": None, "phase": None, "report": None}
    return [
        {
            **common,
            "time": START + 4,
            "kind": "straggler",
            "attempt": 0,
            "step": 20,
            "rank": 1,
            "slowdown": 2.4,
            "phase": "data",
            "text": "gpukit train: straggler: rank 1 (node 0, host h) is 2.4x slower than the "
            "median rank for 20 steps (own time 61 ms vs 25 ms per step), mostly in data",
        },
        {
            **common,
            "time": START + 8,
            "kind": "hang",
            "attempt": 0,
            "step": 37,
            "rank": 1,
            "phase": "backward",
            "text": "gpukit train: rank 1 hung at step 37",
            "report": HANG_REPORT,
        },
        {
            **common,
            "time": START + 9,
            "kind": "restart",
            "attempt": 1,
            "step": 30,
            "rank": 1,
            "text": "gpukit train: restarting (1 of 3): rank 1 hung in rt.backward at train.py:20",
        },
        {
            **common,
            "time": START + 12,
            "kind": "straggler-recovered",
            "attempt": 1,
            "step": 50,
            "rank": 1,
            "text": "gpukit train: straggler: rank 1 recovered",
        },
        {
            **common,
            "time": START + 15,
            "kind": "ended",
            "attempt": 1,
            "step": 60,
            "rank": None,
            "code": 0,
            "text": "gpukit train: finished (exit code 0)",
        },
    ]


def metrics(cpu: bool = True) -> dict[str, Any]:
    """metrics.json of a 2-rank ddp mlp run."""
    device = "cpu" if cpu else "cuda"
    rows = [
        {
            "device": device if cpu else f"cuda:{r}",
            "rank": r,
            "allocated": 300 * MiB,
            "reserved": 300 * MiB,
            "peak": (310 + r) * MiB,
            "total": 16 * 1024 * MiB,
            "free": 8 * 1024 * MiB,
            "other_processes": None,
            "peak_tensors": 150_000,
        }
        for r in range(2)
    ]
    return {
        "workload": "mlp",
        "data": None,
        "final_loss": 0.4321,
        "final_val_loss": 0.5,
        "final_val_accuracy": 0.8,
        "validation": [],
        "steps": 60,
        "resumed_from_step": None,
        "samples_per_s": 1400.0,
        "seconds": 2.7,
        "global_batch": 64,
        "world_size": 2,
        "strategy": "ddp",
        "precision": "32",
        "devices": [device, device],
        "mfu": None,
        "peak_memory": {f"{r['device']} (rank {r['rank']})": r["peak"] for r in rows},
        "memory": {"devices": rows, "imbalance": 1.0},
        "micro_batch": 32,
        "config": {
            "workload": "mlp",
            "max_steps": 60,
            "batch_size": 64,
            "runtime": {"strategy": "ddp", "accumulate": 1, "parallel": None},
        },
    }


def two_rank_run(folder: Path, *, finished: bool = True, corrupt: bool = False) -> Path:
    """A 2-rank run's folder; ``finished`` False leaves metrics.json and the end out;
    ``corrupt`` adds lines that do not parse (a half-written last line among them)."""
    folder.mkdir(parents=True, exist_ok=True)
    samples = []
    for i in range(12):
        step = 5 * (i + 1)
        samples.append(
            {
                "time": START + 1.3 * i,
                "attempt": 0 if i < 7 else 1,
                "ranks": [rank(0, step), rank(1, step, slow=3 <= i <= 8)],
            }
        )
    lines = [json.dumps(s) for s in samples]
    happened = [json.dumps(ev) for ev in events() if finished or ev["kind"] != "ended"]
    if corrupt:
        lines.insert(3, "not json")
        lines.append('{"time": 17000')
        happened.append('{"kind": "restart", "ti')
    (folder / "ranks.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "events.jsonl").write_text("\n".join(happened) + "\n")
    rows = ["step,epoch,elapsed,lr,loss,val_loss,data_wait,data_wait_fraction"]
    rows += [f"{s},1,{s / 20},0.003,{1 / s + 0.4},,0.01,{0.1 + s / 600}" for s in range(10, 70, 10)]
    rows.append("60,1,3.1,0.003,,0.5,,")
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    (folder / "config.toml").write_text(
        'workload = "mlp"\nmax_steps = 60\nstrategy = "ddp"\ndevices = "cpu,cpu"\n'
    )
    if finished:
        (folder / "metrics.json").write_text(json.dumps(metrics(), indent=2))
    return folder
