"""``calibration``: the planner's step time, calibrated on this machine and from the datasheet,
against the step time ``gpukit train`` measures here.

For every small built-in workload (mlp, cnn, gpt; the mlp alone with ``--quick``) and every strategy
that runs on this machine's CPU (single on one device; ddp and fsdp as two gloo processes,
dp and dp-balanced as one process driving two CPU devices, ``--devices cpu,cpu``), all at the
workload's global batch:

- predicted: ``gk.plan`` with :func:`gpukit.planning.calibrate_runs.calibrate_plan` (what
  ``gpukit plan --calibrate`` runs: a few real steps of each strategy here), and without a
  calibration (the datasheet estimate);
- measured: ``gpukit train --max-steps`` in a process of its own, logging every
  :data:`LOG_EVERY` steps; its steady step time is the median of the seconds per step between
  ``metrics.csv`` rows after the first :data:`SKIPPED_STEPS` (the memory-measuring window, the
  first allocations), leaving out spans that hold a validation pass.

Errors are (predicted - measured) / measured. Both sides run in this process's environment
(``OMP_NUM_THREADS`` included), alternated ``repeats`` times (:data:`REPEATS`; 1 with
``--quick``), and their medians are compared, so that a change of the machine's load bends
both.

>>> steady_step([{"step": "5", "elapsed": "1.0", "loss": "2", "val_loss": ""},
...              {"step": "10", "elapsed": "1.5", "loss": "1", "val_loss": ""},
...              {"step": "15", "elapsed": "2.1", "loss": "1", "val_loss": ""}])
0.11
"""

from __future__ import annotations

import csv
import itertools
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.errors import GpukitError
from gpukit.planning.calibrate_runs import calibrate_plan
from gpukit.planning.planner import plan

TITLE = "Step time: planner (calibrated here, and datasheet) vs gpukit train's measurement"
CASES = (("single", 1), ("ddp", 2), ("fsdp", 2), ("dp", 2), ("dp-balanced", 2))
QUICK_CASES = (("single", 1), ("ddp", 2), ("dp", 2))
SKIPPED_STEPS = 5
LOG_EVERY = 5
STEPS = 40  # steps measured after the skipped ones (--steps)
QUICK_STEPS = 10
RUN_TIMEOUT_S = 600
REPEATS = 2  # calibrations and trainings per case, alternated; the medians are compared
WITHIN = 25.0  # %: the calibrated prediction's goal

COLUMNS = (
    Column("workload"),
    Column("strategy"),
    Column("devices"),
    Column("micro_batch", "micro-batch"),
    Column("measured_s", "train", "s/step", 4),
    Column("calibrated_s", "calibrated", "s/step", 4),
    Column("calibrated_error", "cal. error", "%", 1),
    Column("datasheet_s", "datasheet", "s/step", 4),
    Column("datasheet_error", "datasheet error", "%", 0),
)


def run(
    quick: bool = False,
    steps: int | None = None,
    workloads: Sequence[str] | None = None,
    repeats: int | None = None,
) -> BenchResult:
    """Predict and measure every case (see the module doc); ``steps``: training steps timed
    after the skipped ones; calibration times an eighth of them (at least 3) per micro-batch,
    each a block of 5 steps."""
    names = tuple(workloads or (("mlp",) if quick else ("mlp", "cnn", "gpt")))
    cases = QUICK_CASES if quick else CASES
    steps = steps or (QUICK_STEPS if quick else STEPS)
    repeats = repeats or (1 if quick else REPEATS)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    counts = sorted({n for _, n in cases})
    strategies = list(dict.fromkeys(s for s, _ in cases))
    for name in names:
        datasheet = _step_times(
            plan(name, devices=counts, strategies=strategies, method="closed-form")
        )
        predicted: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
        measured: dict[tuple[str, int], list[float]] = {c: [] for c in cases}
        micro: dict[tuple[str, int], int] = {}
        for _ in range(repeats):  # alternated, so that a change of the machine's load bends both
            cal = calibrate_plan(name, list(cases), steps=max(3, steps // 8))
            calibrated = _step_times(
                plan(
                    name,
                    devices=counts,
                    strategies=strategies,
                    calibration=cal,
                    method="closed-form",
                )
            )
            raw.setdefault(f"{name}/calibration", []).append(
                {"single": [cal.micro_batches, cal.step_seconds]}
                | {
                    f"{x.strategy}/{x.devices}": [x.micro_batches, x.step_seconds]
                    for x in cal.lines
                }
            )
            for case in cases:
                seconds, rows_csv = train_step_seconds(name, *case, steps)
                raw.setdefault(f"{name}/{case[0]}/{case[1]}", []).append({"metrics_csv": rows_csv})
                micro[case], guess = calibrated[case]
                predicted[case] += [guess] if guess is not None else []
                measured[case] += [seconds] if seconds is not None else []
        for strategy, n in cases:
            got = _median(measured[(strategy, n)])
            guess = _median(predicted[(strategy, n)])
            rows.append(
                {
                    "workload": name,
                    "strategy": strategy,
                    "devices": n,
                    "micro_batch": micro[(strategy, n)],
                    "measured_s": got,
                    "calibrated_s": guess,
                    "calibrated_error": _error(guess, got),
                    "datasheet_s": datasheet[(strategy, n)][1],
                    "datasheet_error": _error(datasheet[(strategy, n)][1], got),
                }
            )
    errors = [r["calibrated_error"] for r in rows if r["calibrated_error"] is not None]
    worst = max(rows, key=lambda r: abs(r["calibrated_error"] or 0.0))
    return BenchResult(
        experiment="calibration",
        title=TITLE,
        keys=("workload", "strategy", "devices"),
        columns=COLUMNS,
        rows=rows,
        summary={
            "cases": len(rows),
            "largest_calibrated_error_pct": worst["calibrated_error"],
            "largest_calibrated_error_case": f"{worst['workload']} {worst['strategy']}",
            f"within_{WITHIN:.0f}_pct": bool(errors) and all(abs(e) <= WITHIN for e in errors),
        },
        notes=[
            "train: gpukit train's steady seconds per step (median between metrics.csv rows "
            f"after step {SKIPPED_STEPS}); calibrated: gpukit plan --calibrate's step time; "
            "datasheet: gpukit plan's without it; errors are (predicted - measured) / measured",
            "2 devices: cpu,cpu (ddp and fsdp: two gloo processes; dp, dp-balanced: one "
            "process driving both)",
        ],
        parameters={
            "quick": quick,
            "steps": steps,
            "cases": [f"{s} x{n}" for s, n in cases],
            "workloads": list(names),
        },
        environment=environment_of([torch.device("cpu")]),
        raw=raw,
    )


def _step_times(report: Any) -> dict[tuple[str, int], tuple[int, float | None]]:
    return {
        (p.strategy, p.devices): (p.micro_batch, p.step_time.total_s if p.step_time else None)
        for p in report.plans
    }


def train_step_seconds(
    workload: str, strategy: str, devices: int, steps: int
) -> tuple[float | None, list[dict[str, str]]]:
    """``gpukit train``'s steady seconds per step for ``workload`` with ``strategy`` on
    ``devices`` CPU devices (see the module doc), and its metrics.csv rows."""
    total = SKIPPED_STEPS + max(LOG_EVERY, steps // LOG_EVERY * LOG_EVERY)
    with tempfile.TemporaryDirectory(prefix="gpukit-calibration-") as out:
        command = [
            sys.executable,
            "-m",
            "gpukit",
            "train",
            "--workload",
            workload,
            "--strategy",
            strategy,
            "--devices",
            ",".join(["cpu"] * devices),
            "--max-steps",
            str(total),
            "--log-every",
            str(LOG_EVERY),
            "--out",
            out,
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
        if done.returncode:
            raise GpukitError(
                f"`{' '.join(command[2:])}` failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        with (Path(out) / "metrics.csv").open() as file:
            rows = list(csv.DictReader(file))
    return steady_step(rows), rows


def steady_step(rows: Sequence[dict[str, str]]) -> float | None:
    """The median seconds per step between consecutive loss rows of a ``metrics.csv``, after
    :data:`SKIPPED_STEPS`, leaving out spans with a validation row."""
    losses = [(int(r["step"]), float(r["elapsed"])) for r in rows if r.get("loss")]
    checked = [int(r["step"]) for r in rows if r.get("val_loss")]
    rates = [
        (e1 - e0) / (s1 - s0)
        for (s0, e0), (s1, e1) in itertools.pairwise(losses)
        if s0 >= SKIPPED_STEPS and s1 > s0 and not any(s0 <= v < s1 for v in checked)
    ]
    return round(statistics.median(rates), 9) if rates else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def plot(result: BenchResult, path: Path) -> None:
    """The calibrated and the datasheet error per case (the datasheet's clipped at 500%)."""
    rows = result.rows
    labels = [f"{r['workload']}\n{r['strategy']} x{r['devices']}" for r in rows]
    size = (max(8.0, 0.7 * len(rows)), 4.5)
    with figure(path, TITLE, "case", "error vs gpukit train (%)", size=size) as ax:
        xs = range(len(rows))
        ax.bar(
            [x - 0.2 for x in xs],
            [r["calibrated_error"] or 0.0 for r in rows],
            0.4,
            label="calibrated",
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [min(r["datasheet_error"] or 0.0, 500.0) for r in rows],
            0.4,
            label="datasheet",
        )
        ax.axhline(WITHIN, linestyle="--", linewidth=0.8)
        ax.axhline(-WITHIN, linestyle="--", linewidth=0.8)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend()
