"""gpukit bench: the classic experiments, each with a table, or JSON for scripts and records.

Experiments:
    overhead   the per-step cost of a training wrapper: one tiny-MLP training loop in plain
               PyTorch; through gpukit's Runtime as rt.backward + rt.step (gpukit), as
               rt.train_step with Runtime's defaults (gpukit-train-step), and as rt.train_step
               + rt.log with gpukit train's default settings (gpukit-train-default); and through
               Hugging Face Accelerate and Lightning Fabric where those are installed (they are
               never required). Same weights, same batches, same arithmetic in every variant.
               CPU only, one thread; every variant warms up, then R rounds (order rotated each
               round) time N steps of each. Reports the median time per step and the median of
               the per-round ratios to plain, with each wrapper's settings, the machine, the
               versions, the date and the command.
    trace      what gk.trace() costs: N optimizer steps of a built-in workload's training loop
               (gpukit train's; default gpt), or with --workload nanogpt of a script's loop in
               nanoGPT's habits (memmap batches at torch.randint offsets, loss.item() every few
               steps, periodic evaluation), on the best device, untraced and traced, in R
               alternating rounds; the median time per step of each and the median ratio.

A result meant to be kept goes under benchmarks/results/ with --out, which writes the same JSON
that --json prints.

Example:
    gpukit bench overhead
    gpukit bench overhead --steps 500 --rounds 25 --out benchmarks/results/overhead-cpu.json
    gpukit bench overhead --json | python -c "import json,sys; print(json.load(sys.stdin))"
    gpukit bench trace --workload gpt --steps 20 --rounds 5
    gpukit bench trace --workload nanogpt --steps 20 --rounds 7
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from gpukit.bench.overhead import run_overhead
from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.errors import ConfigError

NAME = "bench"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "run a benchmark: wrapper overhead per step, the cost of tracing", __doc__
    )
    experiments = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    overhead = add_command(
        experiments,
        "overhead",
        "per-step cost of gpukit's Runtime (and Accelerate, Fabric) over plain PyTorch",
        __doc__,
    )
    add_json_flag(overhead)
    overhead.add_argument(
        "--steps", type=int, default=200, metavar="N", help="steps timed per round (default 200)"
    )
    overhead.add_argument(
        "--rounds", type=int, default=15, metavar="R", help="rotated rounds (default 15)"
    )
    overhead.add_argument(
        "--out", type=Path, metavar="FILE", help="also write the JSON result to FILE"
    )
    traced = add_command(
        experiments, "trace", "cost of gk.trace() on a training loop (traced / untraced)", __doc__
    )
    add_json_flag(traced)
    traced.add_argument(
        "--workload", default="gpt", help="mlp, cnn, gpt, module:function, or nanogpt"
    )
    traced.add_argument("--steps", type=int, default=20, metavar="N", help="steps per round (20)")
    traced.add_argument("--rounds", type=int, default=5, metavar="R", help="rounds (default 5)")
    traced.add_argument("--out", type=Path, metavar="FILE", help="also write the JSON to FILE")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return _EXPERIMENTS[args.experiment](args)


def _check(args: argparse.Namespace) -> Path | None:
    """Checked before the run, so that a mistake costs no minute of measuring."""
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: give a whole number of at least 1")
    out: Path | None = args.out
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist; create it first")
    return out


def _show(data: dict[str, Any], table: Any, args: argparse.Namespace, out: Path | None) -> None:
    if out is not None:
        out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.json:
        print_json(data)
    else:
        console().print(table)
        if out is not None:
            console().print(f"wrote {out}")


def _trace(args: argparse.Namespace) -> int:
    from gpukit.bench.trace_cost import check_workload, run_trace_cost, table

    out = _check(args)
    check_workload(args.workload)  # an unknown name fails now, not after the warm-up
    with Console(stderr=True).status(f"timing {args.steps} steps x {args.rounds} rounds ..."):
        result = run_trace_cost(args.workload, steps=args.steps, rounds=args.rounds)
    _show(result, table(result), args, out)
    return 0


def _overhead(args: argparse.Namespace) -> int:
    out = _check(args)
    # On stderr, and only on a terminal, so that --json output stays clean for a pipe.
    with Console(stderr=True).status(f"timing {args.steps} steps x {args.rounds} rounds ..."):
        result = run_overhead(steps=args.steps, rounds=args.rounds)
    _show(result.to_dict(), result.table(), args, out)
    return 0


_EXPERIMENTS = {"overhead": _overhead, "trace": _trace}
