"""``plan``: how close the planner's predictions come to what training really holds.

Every small built-in workload (mlp, cnn, gpt; the mlp alone with ``--quick``) trains with single,
ddp and fsdp on 1 and 2 ranks (gloo on this machine's CPU) through ``gpukit train`` (3 steps,
float32, the workload's batch split over the ranks), which records each rank's peak of live
tensors (``peak_tensors`` in ``metrics.json``). Beside each measurement: the simulation's
prediction and the closed form's, and their errors. The simulation runs gpukit's training code
over fake tensors and counts with the same counter, so it should match to the byte; the closed
form is the instant cross-check.

The one source of spread: gloo finishes a collective on its own thread, and that thread may
drop the last reference to a collective's buffer (FSDP's all-gathered parameters) a moment
after the training thread did, so in some runs the buffer is still counted when the next
tensors are made. ``repeats`` runs per case record the lowest and highest rank peak; the
error is taken against the lowest (the peak without that race; on CUDA, freed memory counts
as free at once, so the allocator's max allocated matches it). Rows for 8 and 64 ranks are
simulated only: the per-rank peak must not grow with the count.

``--quick`` measures the mlp alone, once per case, and only single on 1 rank and fsdp on 2
(one run that starts processes, the one that shards; the 1-rank ddp and fsdp rows and ddp on
2 ranks are simulated only), and simulates 8 ranks but not 64: each measured case starts
`gpukit train` processes, the slowest part on a small machine.

>>> settings(quick=True).measured, settings(quick=False).repeats
((('single', 1), ('fsdp', 2)), 3)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpukit.bench.environment import environment_of
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.errors import GpukitError
from gpukit.planning.closed_form import closed_form, model_facts
from gpukit.planning.simulate import simulate
from gpukit.workloads.base import load_workload

TITLE = "Planner vs measurement: predicted and measured peak tensor memory per rank"
CASES = (("single", 1), ("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2))
QUICK_CASES = (("single", 1), ("fsdp", 2))  # measured with --quick
SIMULATED_ONLY = (8, 64)
STEPS = 3
# Seconds a 2-rank `gpukit train` of 3 steps may take before it counts as hung.
RUN_TIMEOUT_S = 300

COLUMNS = (
    Column("workload"),
    Column("strategy"),
    Column("ranks"),
    Column("micro_batch", "micro-batch"),
    Column("measured_min", "measured", "bytes"),
    Column("measured_max", "measured max", "bytes", compare=False),
    Column("simulated", "simulation", "bytes"),
    Column("simulation_error", "sim. error", "%", 3),
    Column("closed_form", "closed form", "bytes"),
    Column("closed_form_error", "c.f. error", "%", 1),
    Column("simulation_s", "sim. time", "s", 2, compare=False),
)


@dataclass(frozen=True)
class PlanMeasurements:
    """What one run measures."""

    workloads: tuple[str, ...]
    repeats: int
    measured: tuple[tuple[str, int], ...] = CASES  # the rest of CASES: simulated only
    simulated_only: tuple[int, ...] = SIMULATED_ONLY


def settings(quick: bool = False) -> PlanMeasurements:
    """Every built-in workload, 3 runs per case; ``quick``: the mlp alone, once per case, fewer
    cases measured and fewer simulated (each measured case starts processes, too slow on a
    2-core machine for more)."""
    if quick:
        return PlanMeasurements(("mlp",), 1, QUICK_CASES, SIMULATED_ONLY[:1])
    return PlanMeasurements(("mlp", "cnn", "gpt"), 3)


def run(quick: bool = False) -> BenchResult:
    """Measure and predict every case (see the module doc)."""
    s = settings(quick)
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    for name in s.workloads:
        workload = load_workload(name, seed=0)
        facts = model_facts(workload.model, workload.dataset[0], loss=workload.loss)
        for strategy, ranks in CASES:
            measured = None
            if (strategy, ranks) in s.measured:
                measured = [measured_peaks(name, strategy, ranks) for _ in range(s.repeats)]
                raw[f"{name}/{strategy}/{ranks}"] = measured
            rows.append(_row(name, strategy, ranks, workload.batch_size, facts, measured))
        for ranks in s.simulated_only:
            for strategy in ("ddp", "fsdp"):
                rows.append(_row(name, strategy, ranks, workload.batch_size, facts, None))
    measured_rows = [r for r in rows if r["measured_min"] is not None]
    worst = max(measured_rows, key=lambda r: abs(r["simulation_error"]))
    worst_cf = max(measured_rows, key=lambda r: abs(r["closed_form_error"]))
    return BenchResult(
        experiment="plan",
        title=TITLE,
        keys=("workload", "strategy", "ranks"),
        columns=COLUMNS,
        rows=rows,
        summary={
            "cases_measured": len(measured_rows),
            "largest_simulation_error_pct": worst["simulation_error"],
            "largest_simulation_error_case": _case(worst),
            "largest_closed_form_error_pct": worst_cf["closed_form_error"],
            "largest_closed_form_error_case": _case(worst_cf),
            "within_5_pct": all(abs(r["simulation_error"]) <= 5 for r in measured_rows),
        },
        notes=[
            "measured: the lowest rank peak of `peak_tensors` over the runs (see the module "
            "doc for the spread in 'measured max'); errors are (predicted - measured) / "
            "measured",
            f"{' and '.join(map(str, s.simulated_only))} ranks: simulated only (no measurement "
            "on a 2-core machine)",
            *(
                [
                    "quick: ddp on 1 and 2 ranks and fsdp on 1 simulated only, 64 ranks left "
                    "out (each measured case starts gpukit train processes)"
                ]
                if quick
                else []
            ),
        ],
        parameters={
            "quick": quick,
            "repeats": s.repeats,
            "steps": STEPS,
            "precision": "32",
            "measured": [f"{strategy} x{ranks}" for strategy, ranks in s.measured],
            "simulated_only_ranks": list(s.simulated_only),
        },
        environment=environment_of([torch.device("cpu")]),
        raw=raw,
    )


def _row(
    name: str,
    strategy: str,
    ranks: int,
    batch: int,
    facts: Any,
    measured: list[list[int]] | None,
) -> dict[str, Any]:
    # The workload's batch split over the ranks (at least one sample each), as gpukit train
    # splits it.
    micro = max(1, batch // ranks)
    start = time.perf_counter()
    simulated = simulate(name, strategy=strategy, devices=ranks, micro_batch=micro)[0].peak_bytes
    seconds = time.perf_counter() - start
    form = max(
        p.peak_bytes
        for p in closed_form(facts, strategy=strategy, devices=ranks, micro_batch=micro)
    )
    flat = [v for run in measured or [] for v in run]
    low, high = (min(flat), max(flat)) if flat else (None, None)
    return {
        "workload": name,
        "strategy": strategy,
        "ranks": ranks,
        "micro_batch": micro,
        "measured_min": low,
        "measured_max": high,
        "simulated": simulated,
        "simulation_error": _error(simulated, low),
        "closed_form": form,
        "closed_form_error": _error(form, low),
        "simulation_s": seconds,
    }


def measured_peaks(name: str, strategy: str, ranks: int) -> list[int]:
    """Every rank's ``peak_tensors`` from one real ``gpukit train`` run."""
    with tempfile.TemporaryDirectory(prefix="gpukit-plan-") as out:
        command = [
            sys.executable,
            "-m",
            "gpukit",
            "train",
            "--workload",
            name,
            "--max-steps",
            str(STEPS),
            "--precision",
            "32",
            "--out",
            out,
            "--strategy",
            strategy,
            "--devices",
            "cpu" if strategy == "single" else str(ranks),
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
        if done.returncode:
            raise GpukitError(
                f"`{' '.join(command[2:])}` failed: {done.stderr.strip().splitlines()[-1:]}"
            )
        rows = json.loads((Path(out) / "metrics.json").read_text())["memory"]["devices"]
        return [int(r["peak_tensors"]) for r in rows]


def _error(predicted: int, measured: int | None) -> float | None:
    return None if measured is None else 100.0 * (predicted - measured) / measured


def _case(row: dict[str, Any]) -> str:
    return f"{row['workload']} {row['strategy']} x{row['ranks']}"


def plot(result: BenchResult, path: Path) -> None:
    """The simulation's and the closed form's error per measured case."""
    rows = [r for r in result.rows if r["measured_min"] is not None]
    labels = [f"{r['workload']}\n{r['strategy']} x{r['ranks']}" for r in rows]
    size = (max(8.0, 0.7 * len(rows)), 4.5)
    with figure(path, TITLE, "case", "error vs measured (%)", size=size) as ax:
        xs = range(len(rows))
        ax.bar(
            [x - 0.2 for x in xs], [r["simulation_error"] for r in rows], 0.4, label="simulation"
        )
        ax.bar(
            [x + 0.2 for x in xs], [r["closed_form_error"] for r in rows], 0.4, label="closed form"
        )
        ax.axhline(5, linestyle="--", linewidth=0.8)
        ax.axhline(-5, linestyle="--", linewidth=0.8)
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend()
