"""``gpukit report DIR``: one self-contained HTML page of a ``gpukit train --out DIR`` run,
finished, failed or still running.

The page (``DIR/report.html`` unless told otherwise) holds the run's headline (workload,
strategy, devices, steps, final loss, status), its loss and validation curves, each rank's
throughput, step time and memory over time, the time spent waiting for data, the restarts,
stragglers and hangs on a timeline with the hang reports, the plan against what was measured,
the settings, and any trace or profile files. Records are read by
:mod:`gpukit.watch.run_records`, drawn by :mod:`gpukit.watch.report_plots` and laid out by
:mod:`gpukit.watch.report_page`.

``gpukit train --out DIR`` writes it at the end of every run (:func:`write_quietly`): a
report that cannot be written costs one warning line, never the run.

>>> import tempfile
>>> from pathlib import Path
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "metrics.csv").write_text("step,loss\\n10,0.9\\n20,0.7\\n")
>>> written = write_report(folder)
>>> written.path.name, written.summary
('report.html', 'failed: workload not recorded, 20 steps, final loss 0.7000')
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpukit._util.files import write_atomic
from gpukit.errors import GpukitError, warn_user
from gpukit.watch import report_plots
from gpukit.watch.plan_check import plan_check
from gpukit.watch.report_page import headline, render
from gpukit.watch.run_records import Ended, RunRecords, read_run

REPORT = "report.html"


@dataclass
class RunEnd:
    """What ``gpukit train`` knows of its run at its end, for the page: whether it began
    training (past every check: a request refused before leaves the folder as it was) and
    how it ended."""

    began: bool = False
    ended: Ended = field(default_factory=lambda: Ended(1, "failed"))


@dataclass(frozen=True)
class Written:
    """Where the page went, and the run in one line."""

    path: Path
    summary: str


def write_report(
    folder: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    ended: Ended | None = None,
    plan_method: str = "auto",
) -> Written:
    """Read the run in ``folder`` and write its page to ``output`` (default
    ``folder/report.html``), replaced whole. ``ended``: how the run ended, when the caller
    ran it. ``plan_method``: the planner's ("closed-form" is instant; "auto" simulates where
    it can, a second or two). ConfigError for a folder that is no run; OutputWriteError,
    naming the file and the fix, when it cannot be written."""
    run = read_run(folder, ended)
    figures = {
        "loss": report_plots.loss_curves(run.history, _resumed_from(run)),
        "throughput": report_plots.throughput(run.samples),
        "memory": report_plots.memory(run.samples),
        "data_wait": report_plots.data_wait(run.history, run.samples),
        "timeline": report_plots.timeline(run.events, _start(run)),
    }
    checked = plan_check(run.metrics, run.samples, method=plan_method)
    page = render(run, figures, checked)
    path = Path(output) if output is not None else run.folder / REPORT
    write_atomic(path, page, option="--output" if output is not None else "the run's folder")
    return Written(path, summary(run))


def summary(run: RunRecords) -> str:
    """The run in one line: its status, workload, steps and final loss."""
    rows = dict(headline(run))
    what = run.workload or "workload not recorded"
    return f"{run.status}: {what}, {rows['steps']} steps, final loss {rows['final loss']}"


def write_quietly(folder: str | os.PathLike[str], ended: Ended) -> Path | None:
    """:func:`write_report` at the end of a ``gpukit train`` run, with the planner's closed
    form (instant); a failure is one warning line, and None."""
    try:
        return write_report(folder, ended=ended, plan_method="closed-form").path
    except Exception as err:  # whatever it is, the run's own outcome is what counts
        said = str(err) if isinstance(err, GpukitError) else f"{type(err).__name__}: {err}"
        warn_user(f"gpukit train: no {REPORT} in {folder}: {said}")
        return None


def _resumed_from(run: RunRecords) -> int | None:
    value = (run.metrics or {}).get("resumed_from_step")
    return value if isinstance(value, int) else None


def _start(run: RunRecords) -> float | None:
    times = [float(s["time"]) for s in run.samples]
    return min(times) if times else None
