"""gpukit bench: the classic GPU experiments, measured correctly, on the CPU and every GPU here.

Experiments (each runs alone as `gpukit bench NAME`, all in turn as `gpukit bench all`):
    matmul       square products 16..8192 in fp32 (tf32, bf16, fp16 on GPUs): time, TFLOP/s,
                 share of the device's peak; the size from which each GPU beats the CPU, with
                 and without the host<->device copies
    transfer     host->device, device->host, device->device bandwidth against size, pageable vs
                 pinned, blocking vs non_blocking overlapped with compute, tiny-copy latency,
                 share of the PCIe link's peak (on a CPU: host memory copies)
    sync         1000 products of 100x100 matrices reading the norm back every step (.item(),
                 print) vs logging on the device and reading once: the cost of one wait
    multidevice  A^10 + B^10 with A and B on two devices vs one; two streams; CPU + GPU at once
    strategies   samples/s, GPU utilisation and peak memory per device of every strategy on
                 the cnn and gpt workloads, scaling with the number of devices, and the
                 planner's predicted peak of tensors beside the measured one
    precision    fp32 vs bf16-mixed vs 16-mixed, channels_last, torch.compile: samples/s and
                 the final loss after a fixed number of steps
    overhead     the per-step cost of gpukit's Runtime (and Accelerate, Fabric) over plain
                 PyTorch, on a tiny MLP, CPU, one thread
    trace        the cost of gk.trace() on gpukit train's loop and on a nanoGPT-style loop
    speed        tokens/s, MFU and peak memory of gpt2 (GPT-2 small) and Llama 3.2 1B's shape
                 under FSDP2 (on a CPU: a few narrow layers) through gpukit train's loop,
                 gk.Runtime in a user's loop and the plain loop of nanoGPT (gpt2) or
                 torchtitan (llama), side by side, with each one's ratio to the plain loop and
                 its first losses checked against the plain loop's
    plan         the planner's predicted peak tensor memory per rank (simulation and closed
                 form) against gpukit train's measured one, every built-in workload x single,
                 ddp, fsdp x 1, 2 ranks; 8 and 64 ranks simulated
    calibration  the planner's step time, calibrated here (gpukit plan --calibrate) and from
                 the datasheet, against gpukit train's, every built-in workload x every
                 strategy on this CPU (single; ddp, fsdp, dp, dp-balanced on cpu,cpu)
    restarts     a 2-rank gpukit train that fails once under --max-restarts 1: the restart's
                 phases (stop, python, import torch, import gpukit, process group, set-up,
                 first step) beside the cold start's, and restart / cold start; with
                 --soak N [--seed S]: N kill -9s (and SIGTERMs) at random moments of a run
                 under --max-restarts 60, the time each cost, and whether it ends bitwise
                 equal to a run without them
    save         the stall of rt.save() with async_save against a synchronous save of the
                 same model (4 square layers, AdamW), as a ratio; the goal is <= 0.10

Every experiment warms up, synchronises before reading clocks (CUDA events on a GPU), repeats
and reports the median with its spread, and rotates its inputs. --quick runs sizes a 2-core CI
machine finishes in minutes. --out DIR writes NAME.json (machine, versions, date, command,
parameters, raw timings) and NAME.png; `all --out DIR` adds report.md. `compare A.json
B.json` (or two such folders) shows two runs side by side with the ratio of every figure.

Example:
    gpukit bench matmul
    gpukit bench transfer --quick --json
    gpukit bench all --quick --out bench-results
    gpukit bench compare old/matmul.json new/matmul.json
    gpukit bench overhead --steps 200 --rounds 40
    gpukit bench trace --workload nanogpt --steps 20 --rounds 7
    gpukit bench speed --quick
    gpukit bench restarts --soak 10 --seed 7
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from gpukit._util.files import write_atomic
from gpukit.bench.result import BenchResult, load_result
from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.errors import ConfigError

NAME = "bench"
_ONE_LINERS = {
    "matmul": "matrix-product speed and share of peak, CPU vs each GPU, per dtype",
    "transfer": "host<->device and device<->device copy bandwidth, pageable vs pinned",
    "sync": "what reading a value back every step costs",
    "multidevice": "two devices (or streams, or CPU + GPU) at once vs one",
    "strategies": "samples/s, utilisation and memory per device of every strategy",
    "precision": "fp32 vs mixed precision, channels_last, torch.compile",
    "overhead": "per-step cost of gpukit's Runtime (and Accelerate, Fabric) over plain PyTorch",
    "trace": "cost of gk.trace() on a training loop (traced / untraced)",
    "speed": "tokens/s of gpt2 and Llama 1B (fsdp): gpukit train, gk.Runtime, plain loops",
    "plan": "the planner's predicted peak memory against gpukit train's measured one",
    "calibration": "the planner's step time (calibrated, datasheet) against gpukit train's",
    "restarts": "what a restart under gpukit's launcher costs, phase by phase, vs a cold start",
    "save": "the stall of a checkpoint written in the background vs a synchronous save",
}


def register(sub: Any) -> None:
    from gpukit.bench.suite import names

    parser = add_command(
        sub, NAME, "run the classic GPU experiments, tabulated and plotted", __doc__
    )
    experiments = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name in names():
        one = add_command(experiments, name, _ONE_LINERS[name], __doc__)
        _add_run_flags(one)
        if name in ("overhead", "trace", "speed"):
            one.add_argument("--steps", type=int, metavar="N", help="steps timed per round")
            one.add_argument("--rounds", type=int, metavar="R", help="rounds")
        if name == "save":
            one.add_argument("--rounds", type=int, metavar="R", help="saves of each kind timed")
        if name == "restarts":
            one.add_argument(
                "--soak",
                type=int,
                metavar="N",
                help="instead: N faults at random moments of a run under --max-restarts 60, "
                "and whether it ends bitwise equal to a run without them",
            )
            one.add_argument(
                "--seed", type=int, metavar="S", help="the soak's faults (default: new)"
            )
        if name == "calibration":
            one.add_argument("--steps", type=int, metavar="N", help="training steps timed")
        if name == "trace":
            one.add_argument(
                "--workload",
                help="mlp, cnn, gpt, gpt2, module:function, or nanogpt (default: gpt and nanogpt)",
            )
    everything = add_command(experiments, "all", "every experiment, then report.md", __doc__)
    _add_run_flags(everything)
    everything.add_argument(
        "--only", metavar="NAMES", help="comma-separated experiments to run (default: all)"
    )
    compare = add_command(experiments, "compare", "two runs side by side, with ratios", __doc__)
    add_json_flag(compare)
    compare.add_argument("a", type=Path, metavar="A", help="NAME.json, or a folder of them")
    compare.add_argument("b", type=Path, metavar="B", help="NAME.json, or a folder of them")
    parser.set_defaults(run=run)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    add_json_flag(parser)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (minutes on 2 cores)")
    parser.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write NAME.json and NAME.png there (created if missing); a path ending in .json "
        "writes only that JSON file",
    )


def run(args: argparse.Namespace) -> int:
    if args.experiment == "compare":
        return _compare(args)
    if args.experiment == "all":
        return _all(args)
    return _one(args)


def _one(args: argparse.Namespace) -> int:
    from gpukit.bench.suite import experiment

    folder, json_file = _check_out(args.out)
    module = experiment(args.experiment)
    options = _options(args)
    with Console(stderr=True).status(f"gpukit bench {args.experiment} ..."):
        result: BenchResult = module.run(quick=args.quick, **options)
    files = []
    if json_file is not None:
        write_atomic(json_file, json.dumps(result.to_dict(), indent=2, default=str) + "\n")
        files.append(json_file)
    elif folder is not None:
        files.append(result.write_json(folder))
        png = folder / f"{args.experiment}.png"
        module.plot(result, png)
        files.append(png)
    _show(result, args.json, files)
    return 0


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The experiment-specific flags, checked before any minute is spent measuring."""
    options: dict[str, Any] = {}
    for flag in ("steps", "rounds"):
        value = getattr(args, flag, None)
        if value is not None:
            if value < 1:
                raise ConfigError(f"--{flag} {value}: give a whole number of at least 1")
            options[flag] = value
    soak = getattr(args, "soak", None)
    if soak is not None:
        if soak < 1:
            raise ConfigError(f"--soak {soak}: give a whole number of faults, at least 1")
        options["soak"] = soak
    if getattr(args, "seed", None) is not None:
        if soak is None:
            raise ConfigError(f"--seed {args.seed}: it seeds --soak N; give --soak too")
        options["seed"] = args.seed
    workload = getattr(args, "workload", None)
    if workload is not None:
        from gpukit.bench.trace_cost import check_workload

        check_workload(workload)  # an unknown name fails now, not after the warm-up
        options["workloads"] = (workload,)
    return options


def _all(args: argparse.Namespace) -> int:
    from gpukit.bench.report import write_report
    from gpukit.bench.suite import names, run_all

    folder, json_file = _check_out(args.out)
    if json_file is not None:
        raise ConfigError(
            f"--out {args.out}: `bench all` writes a folder (one JSON and one plot per "
            "experiment, and report.md); give a folder name, not a .json file"
        )
    only = _only(args.only, names())
    start = time.perf_counter()
    with Console(stderr=True).status("gpukit bench all ..."):
        outcomes = run_all(args.quick, folder, only)
    minutes = (time.perf_counter() - start) / 60
    files = [f for o in outcomes for f in o.files]
    if folder is not None:
        command = shlex.join(sys.orig_argv)
        files.append(write_report(folder, outcomes, command, args.quick, minutes))
    failed = [o for o in outcomes if o.result is None]
    if args.json:
        print_json(
            {
                o.name: o.result.to_dict() if o.result is not None else {"error": o.error}
                for o in outcomes
            }
        )
    else:
        out = console()
        for o in outcomes:
            if o.result is not None:
                out.print(o.result.table())
            else:
                out.print(f"[red]{o.name} failed:[/red] {o.error}", markup=True)
            if o.plot_error:
                out.print(f"{o.name}: no plot ({o.plot_error})")
            out.print()
        out.print(
            f"{len(outcomes) - len(failed)} of {len(outcomes)} experiments ran in {minutes:.1f} min"
        )
        for f in files:
            out.print(f"wrote {f}")
    return 1 if failed else 0


def _compare(args: argparse.Namespace) -> int:
    from gpukit.bench.compare import compare

    pairs = _pairs(args.a, args.b)
    compared = [compare(load_result(a), load_result(b), str(a), str(b)) for a, b in pairs]
    if args.json:
        print_json([c.to_dict() for c in compared])
    else:
        for c in compared:
            console().print(c.table())
    return 0


def _pairs(a: Path, b: Path) -> list[tuple[Path, Path]]:
    if a.is_dir() != b.is_dir():
        raise ConfigError(f"compare {a} {b}: give two NAME.json files or two folders of them")
    if not a.is_dir():
        return [(a, b)]
    common = sorted({p.name for p in a.glob("*.json")} & {p.name for p in b.glob("*.json")})
    if not common:
        raise ConfigError(
            f"compare {a} {b}: the folders have no NAME.json in common; give folders that "
            "`gpukit bench ... --out` wrote"
        )
    return [(a / name, b / name) for name in common]


def _only(text: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    if text is None:
        return ()
    wanted = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in wanted if n not in known]
    if unknown or not wanted:
        raise ConfigError(
            f"--only {text!r}: {', '.join(unknown) or 'no names'} not an experiment; give "
            f"comma-separated names from {', '.join(known)}"
        )
    return wanted


def _check_out(out: Path | None) -> tuple[Path | None, Path | None]:
    """(folder, JSON file) for ``--out``, made and checked writable before any measuring."""
    if out is None:
        return None, None
    if out.suffix == ".json" and not out.is_dir():
        if not out.parent.is_dir():
            raise ConfigError(f"--out {out}: the folder {out.parent} does not exist; create it")
        _check_writable(out, out.parent)
        if out.exists():
            try:  # the file's own permissions (opened without changing it)
                out.open("r+b").close()
            except OSError as err:
                raise _unwritable(out, err) from None
        return None, out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file is there; give a folder for the results")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(out, err) from None
    _check_writable(out, out)
    return out, None


def _check_writable(out: Path, folder: Path) -> None:
    """Write and remove a file in ``folder``: what fails there fails now, before the run
    (``os.access`` would not do: it answers yes to root on a read-only mount)."""
    probe = folder / ".gpukit-write-check"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise _unwritable(out, err) from None


def _unwritable(out: Path, err: OSError) -> ConfigError:
    return ConfigError(
        f"--out {out}: cannot write there ({err.strerror or err}); give a folder you can "
        "write to, or a NAME.json file in one"
    )


def _show(result: BenchResult, as_json: bool, files: list[Path]) -> None:
    if as_json:
        print_json(result.to_dict())
        return
    out = console()
    out.print(result.table())
    for f in files:
        out.print(f"wrote {f}")
