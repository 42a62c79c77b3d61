"""gpukit report: one self-contained HTML page of a gpukit train --out DIR run.

Reads what the run wrote in DIR (metrics.json, metrics.csv, config.toml, checkpoints/) and what
gpukit's launcher recorded there (ranks.jsonl: every rank's throughput, step time, memory and
data share over time; events.jsonl: restarts with their cause, stragglers, hangs with their
report, the end), and writes DIR/report.html: the run's headline (workload, strategy, devices,
steps, final loss; finished, running, stopped or failed), its loss and validation curves, each
rank's throughput, step time and memory, the time spent waiting for data, the events on a
timeline with a table, the planner's peak memory and step time for the run beside what was
measured, the settings, and any trace or profile files. The run may be finished, failed or
still running; what its folder does not hold, the page says. The page needs nothing outside
it (figures are inline SVG): open it in any browser, offline, or mail it.

gpukit train --out DIR writes DIR/report.html at the end of every run by itself; this
command writes it again (a running run's, say), with the planner's simulation where the run's
own end used its closed form.

Example:
    gpukit report runs/mlp
    gpukit report runs/gpt --output /tmp/gpt.html
"""

from __future__ import annotations

import argparse
from typing import Any

from gpukit.cli._common import add_command, console
from gpukit.watch.report import write_report

NAME = "report"


def register(sub: Any) -> None:
    parser = add_command(sub, NAME, "write one HTML page of a gpukit train --out run", __doc__)
    parser.add_argument("folder", metavar="DIR", help="the run's folder (gpukit train --out DIR)")
    parser.add_argument(
        "--output", metavar="FILE", default=None, help="where to write it (default DIR/report.html)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    written = write_report(args.folder, args.output)
    out = console()
    out.print(str(written.path), markup=False, highlight=False)
    out.print(written.summary, markup=False, highlight=False)
    return 0
