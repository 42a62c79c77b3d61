"""gpukit doctor: check the whole GPU stack, each layer OK/WARN/FAIL with a one-line fix.

Layers: OS, Python, CPU, RAM; the torch build, its CUDA runtime, cuDNN, NCCL, gloo; the NVIDIA
driver and the newest CUDA it supports; every GPU (memory, compute capability, kernels in this
build, utilisation, a real test allocation); GPUs NVML sees but torch does not, and why;
peer-to-peer access; bf16/TF32; MPS on macOS; CUDA/NCCL variables that are set.

Exit code 0 when nothing FAILs (a CPU-only machine is a valid setup), 1 otherwise.

Example:
    gpukit doctor
    gpukit doctor --json | python -c "import json,sys; print(json.load(sys.stdin)['status'])"
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.markup import escape
from rich.table import Table

from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.doctor import diagnose

NAME = "doctor"
_STYLE = {"OK": "green", "WARN": "yellow", "FAIL": "bold red"}


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "check the GPU stack: driver, CUDA, cuDNN, NCCL, torch build, each GPU", __doc__
    )
    add_json_flag(parser)
    parser.add_argument(
        "--no-alloc", action="store_true", help="skip the test allocation on each GPU"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    report = diagnose(test_allocation=not args.no_alloc)
    if args.json:
        print_json(report.to_dict())
    else:
        table = Table(title="gpukit doctor", title_justify="left", header_style="bold")
        for column in ("check", "status", "detail / fix"):
            table.add_column(column, overflow="fold")
        for c in report.checks:
            text = escape(c.detail) + (f"\n[cyan]fix: {escape(c.fix)}[/]" if c.fix else "")
            table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", text)
        out = console()
        out.print(table)
        counts = {s: sum(c.status == s for c in report.checks) for s in _STYLE}
        out.print(f"{counts['OK']} OK, {counts['WARN']} WARN, {counts['FAIL']} FAIL")
    return 0 if report.ok else 1
