"""``restarts``: what a restart under gpukit's launcher costs, against a cold start of the same
job measured in the same run.

The job: ``gpukit train --workload mlp`` on 2 ranks (ddp, gloo on this machine's CPU) under
``run_job`` with ``--max-restarts 1``, and ``GPUKIT_FAULT=raise:1:3`` (rank 1 raises as it
begins step 3, once per job), so attempt 0 fails and attempt 1 trains to the end. Each rank
runs through :mod:`gpukit.bench.restart_rank`, which writes when its start-up reached each
point; the launcher writes each attempt's times (``attempts.jsonl``). From them, per attempt
(the cold start is attempt 0, the restart attempt 1), in seconds, the slowest rank's:

- ``stop``: the failure (the first rank's, by its error record) to every rank gone (restart only);
- ``relaunch``: every rank gone to the next attempt's processes started (restart only);
- ``python start``: processes started to the script's first line (the interpreter, the runner);
- ``import torch``, ``import gpukit`` (with its command line);
- ``to the Runtime``: the command line parsed, settings and strategy made, the first heartbeat;
- ``process group``: joining it (the rendezvous on the attempt's port);
- ``model and data``: the workload built, to ``rt.setup``;
- ``to the first step``: ``rt.setup`` to the first step done;
- the launcher's own view: ``start → first beat`` and ``first beat → first step`` (as its
  summary prints them: beats are read every 0.15 s);
- ``total``: cold, the processes started to the first step; restart, the failure to the first
  step of the next attempt. ``restart / cold`` is their ratio, the headline.

The restart's ranks are forked from the launcher's own warm-start server
(``gpukit.launch.warm_restarts``), the cold start's are fresh interpreters; with
``GPUKIT_WARM_RESTART=0`` both are cold (the figures before the launcher kept a server), with
``GPUKIT_WARM_START`` both are forked from the user's server. The result says which
(``restarts_from``).

Phases are per-rank differences of marks, the largest over the ranks, so they need not add up
exactly. ``repeats`` jobs (3; 1 with ``--quick``) give medians; the load average before and
after is kept (``os.getloadavg``): on a shared machine it moves every figure.

>>> [name for name, _ in PHASES][:3]
['stop', 'relaunch', 'python start']
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gpukit import _env
from gpukit.bench import restart_rank
from gpukit.bench.environment import environment_of
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.errors import GpukitError
from gpukit.launch import RUNNER, run_job
from gpukit.launch.restarts import ATTEMPTS_FILE

TITLE = "What a restart costs under gpukit's launcher, against a cold start of the same job"
FAULT = "raise:1:3"
STEPS = 5
NPROC = 2
# (phase, (from mark, to mark)) of a rank's start-up; launcher-side phases are computed apart.
_RANK_PHASES = (
    ("import torch", ("script", "torch")),
    ("import gpukit", ("torch", "gpukit")),
    ("to the Runtime", ("gpukit", "start")),
    ("process group", ("start", "joined")),
    ("model and data", ("joined", "setup")),
    ("to the first step", ("setup", "step")),
)
PHASES = (
    ("stop", "failure to every rank gone"),
    ("relaunch", "every rank gone to the next processes started"),
    ("python start", "processes started to the script's first line"),
    *((name, f"marks {a} to {b}") for name, (a, b) in _RANK_PHASES),
    ("start → first beat", "launcher's view: processes started to every rank's first beat"),
    ("first beat → first step", "launcher's view: every rank's first beat to the first step"),
    ("total", "cold: started to first step; restart: failure to the next first step"),
)
COLUMNS = (
    Column("phase"),
    Column("cold", "cold start", "s", 2),
    Column("restart", "restart", "s", 2),
    Column("what", "measured", compare=False),
)


def command(steps: int = STEPS) -> list[str]:
    """One rank's command line: ``gpukit train`` through the runner and the marking script."""
    script = str(Path(restart_rank.__file__).resolve())
    train = ["train", "--workload", "mlp", "--strategy", "ddp", "--max-steps", str(steps)]
    return [sys.executable, str(RUNNER), script, *train]


def one_job(folder: Path) -> dict[str, dict[str, float | None]]:
    """Run the job once in ``folder``; each phase's seconds, for the cold start and the
    restart (None where it does not apply or was not seen)."""
    out = io.StringIO()
    code = run_job(
        command(), NPROC, max_restarts=1, env={"GPUKIT_FAULT": FAULT}, out=out, job_dir=folder
    )
    if code != 0:
        raise GpukitError(f"the restarted job exited {code}:\n{out.getvalue()}")
    attempts = [json.loads(line) for line in (folder / ATTEMPTS_FILE).read_text().splitlines()]
    if len(attempts) != 2:
        raise GpukitError(f"expected 2 attempts, the launcher recorded {len(attempts)}")
    cold = _phases(folder, attempts[0], None)
    restart = _phases(folder, attempts[1], attempts[0])
    return {"cold": cold, "restart": restart}


def _phases(folder: Path, attempt: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    number, started = attempt["attempt"], attempt["started"]
    marks = [
        json.loads((folder / f"marks-{rank}-{number}.json").read_text()) for rank in range(NPROC)
    ]
    found: dict[str, float | None] = {
        "python start": max(m["script"] for m in marks) - started,
        **{name: max(m[b] - m[a] for m in marks) for name, (a, b) in _RANK_PHASES},
        "start → first beat": _minus(attempt["all_beaten"], started),
        "first beat → first step": _minus(attempt["first_step"], attempt["all_beaten"]),
        "stop": None,
        "relaunch": None,
    }
    first_step = max(m["step"] for m in marks)
    if before is None:
        found["total"] = first_step - started
    else:
        found["stop"] = _minus(before["gone"], before["failed"])
        found["relaunch"] = _minus(started, before["gone"])
        found["total"] = _minus(first_step, before["failed"])
    return found


def _started_from() -> str:
    """How the restarted attempt's ranks start (see ``gpukit.launch.warm_restarts``)."""
    if _env.warm_start() is not None:
        return "forked from the warm-start server GPUKIT_WARM_START names (both attempts)"
    if not _env.warm_restart():
        return "fresh interpreters, as the cold start's (GPUKIT_WARM_RESTART=0)"
    return "forked from the launcher's own warm-start server"


def _minus(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else later - earlier


def run(quick: bool = False, soak: int | None = None, seed: int | None = None) -> BenchResult:
    """Run the job ``repeats`` times (see the module doc) and report the medians; with
    ``soak``, the soak instead (``gpukit.bench.soak``: that many faults, ``seed``)."""
    if soak is not None:
        from gpukit.bench import soak as soaked

        return soaked.run(quick, soak, seed)
    repeats = 1 if quick else 3
    started_from = _started_from()
    load_before = os.getloadavg()
    jobs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="gpukit-restarts-") as folder:
            jobs.append(one_job(Path(folder)))
    load_after = os.getloadavg()
    rows = []
    for name, what in PHASES:
        row: dict[str, Any] = {"phase": name, "what": what}
        for side in ("cold", "restart"):
            values = [v for j in jobs if (v := j[side][name]) is not None]
            row[side] = statistics.median(values) if values else None
        rows.append(row)
    totals = next(r for r in rows if r["phase"] == "total")
    ratios = [j["restart"]["total"] / j["cold"]["total"] for j in jobs]  # type: ignore[operator]
    return BenchResult(
        experiment="restarts",
        title=TITLE,
        keys=("phase",),
        columns=COLUMNS,
        rows=rows,
        summary={
            "cold_start_s": totals["cold"],
            "restart_s": totals["restart"],
            "restart_over_cold": statistics.median(ratios),
            "load_before": round(load_before[0], 2),
            "load_after": round(load_after[0], 2),
            "restarts_from": started_from,
        },
        notes=[
            f"{NPROC} ranks of `gpukit train --workload mlp --strategy ddp --max-steps {STEPS}`"
            f" under gpukit's launcher, GPUKIT_FAULT={FAULT}, --max-restarts 1; medians of "
            f"{repeats} job(s), each phase the slowest rank's",
            "restart_over_cold: the median of each job's restart total over its cold start",
            f"the restart's ranks: {started_from}",
        ],
        parameters={
            "quick": quick,
            "repeats": repeats,
            "nproc": NPROC,
            "steps": STEPS,
            "fault": FAULT,
            "loadavg_before": list(load_before),
            "loadavg_after": list(load_after),
        },
        environment=environment_of([torch.device("cpu")]),
        raw={"jobs": jobs},
    )


def plot(result: BenchResult, path: Path) -> None:
    """Each phase's seconds, cold start beside restart."""
    if "fault" in result.keys:  # a soak's result
        from gpukit.bench import soak

        return soak.plot(result, path)
    rows = [r for r in result.rows if r["phase"] != "total"]
    with figure(path, TITLE, "phase", "seconds (median)", size=(11.0, 4.5)) as ax:
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["cold"] or 0.0 for r in rows], 0.4, label="cold start")
        ax.bar([x + 0.2 for x in xs], [r["restart"] or 0.0 for r in rows], 0.4, label="restart")
        ax.set_xticks(list(xs), [r["phase"] for r in rows], fontsize=7, rotation=20)
        ax.legend()
