"""gpukit check: what moving a script from Accelerate, Lightning Fabric, plain DDP (torchrun)
or mp.spawn to gpukit changes, read from its source without running or importing it.

Prints one row per call the script makes (its line, the call as written, gpukit's spelling,
and how the two behave differently where they do), then the behaviours that will differ for
this script, one a line. The whole table and a program moved each way: docs/migrating.md.

Exit code 0 whenever the file could be read, calls found or not; 2 when it is missing or is
not Python (the line where it stops being Python is named).

Example:
    gpukit check train.py
    gpukit check train.py --json
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.migration import scan_file
from gpukit.migration.table import plain

NAME = "check"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "list a script's Accelerate, Fabric or DDP calls and gpukit's spelling", __doc__
    )
    add_json_flag(parser)
    parser.add_argument("script", help="the Python script to read (it is not run)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    scan = scan_file(args.script)
    if args.json:
        print_json(
            {
                "script": args.script,
                "libraries": scan.libraries,
                "calls": [f.to_dict() for f in scan.findings],
                "behaviours": [plain(b) for b in scan.behaviours],
            }
        )
        return 0
    out = console()
    if not scan.findings:
        out.print(
            f"{escape(args.script)}: no Accelerate, Fabric, DDP or mp.spawn calls found; "
            "nothing to change (docs/migrating.md)"
        )
        return 0
    table = Table(title=f"gpukit check {escape(args.script)}", title_justify="left")
    table.add_column("line", justify="right")
    for column, width in (("call", 36), ("gpukit", 32), ("differs", 40)):
        table.add_column(column, overflow="fold", max_width=width)
    for f in scan.findings:
        written = f.written if len(f.written) <= 60 else f.written[:57] + "..."
        table.add_row(str(f.line), escape(written), escape(plain(f.gpukit)), escape(plain(f.note)))
    out.print(table)
    if scan.behaviours:
        out.print("What will behave differently:")
        width = min(out.width, 100)
        for behaviour in scan.behaviours:
            text = textwrap.fill(
                plain(behaviour), width, initial_indent="- ", subsequent_indent="  "
            )
            out.print(escape(text), soft_wrap=True)
    return 0
