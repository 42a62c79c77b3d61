"""gpukit top: every rank of a running job, live, from any node of the job.

Reads the view the job's launcher rewrites about once a second (JOB/live.json in its job
folder) and draws it: the job's progress, throughput and time left, then one row per rank
(its step, step time, samples/s, phase, where its step time goes, memory, and its GPU's
utilisation, power, temperature, clock and throttling), the stragglers named in red, the notes
and the last events. q or Ctrl-C quits.

Without options it watches the one gpukit job running on this machine (and lists them when
there are several); --job DIR names a job folder, --out OUT the run `gpukit train --out OUT`
writes. --json prints the view as one JSON line per interval instead (off a terminal too);
--once prints one screen and exits. It only reads files: it cannot slow or stop the job.

Example:
    gpukit top
    gpukit top --out runs/gpt
    gpukit top --json --interval 5 >> ranks.jsonl
    gpukit top --once --job /tmp/gpukit-job-4242-x1y2z3
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from gpukit.cli._common import add_command
from gpukit.errors import ConfigError
from gpukit.watch.jobs import find_job
from gpukit.watch.live import Mode, watch

NAME = "top"


def register(sub: Any) -> None:
    parser = add_command(sub, NAME, "watch every rank of a running job, live", __doc__)
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--job", metavar="DIR", help="the job folder to watch ($TMPDIR/gpukit-job-*)"
    )
    where.add_argument("--out", metavar="OUT", help="watch the job of the run writing to OUT")
    show = parser.add_mutually_exclusive_group()
    show.add_argument(
        "--json", action="store_true", help="print the view as one JSON line per interval"
    )
    show.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between two reads of the view (default: 1)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise ConfigError(
            f"--interval {args.interval:g}: give the seconds between two reads, a number > 0 "
            "(e.g. --interval 1; the view is rewritten about once a second)"
        )
    folder = find_job(job=args.job, out=args.out)
    mode: Mode = "json" if args.json else "once" if args.once else "live"
    return watch(folder, interval=args.interval, mode=mode)
