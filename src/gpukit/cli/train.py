"""gpukit train: train a built-in or your own workload on every device, with the same loop.

Workloads: mlp, cnn, gpt (character-level transformer on bundled public-domain text, default),
or package.module:function returning a Workload or (model, dataset, loss). With more than one
device, one DDP process per device is started (or, with --strategy dp or dp-balanced, one
process drives them all). Rank 0 shows a progress bar (loss, samples/s, ETA); when stdout is
not a terminal (CI, a pipe, a file) it prints a plain line instead (steps, epoch, loss,
samples/s, ETA) every --progress-every SECONDS (default 30; 0: after every step) and at the
start and end of each epoch. The loss shown is the last one read back (--log-every): showing
progress never makes the host wait for the device. At the end: a summary with throughput, MFU
on GPUs, and memory per device with the imbalance between devices (max/min peak).

When a device runs out of memory in a single-process run, the step is redone with the batch cut
into more micro-batches (--oom auto, the default: recovery costs nothing per step there); under
DDP the run stops with an explanation, since recovering there costs DDP its overlap of
communication with the backward (--oom recover: recover anyway; --oom raise: always stop and
explain).

With --out DIR: DIR/metrics.json, DIR/metrics.csv (a row per read-back, written as they come),
DIR/loss.png and DIR/checkpoints/ (one per epoch). --resume continues from the newest
checkpoint exactly where it stopped, appends to metrics.csv (dropping rows for steps after that
checkpoint, which a run that died had logged) and draws loss.png from the whole run.

--strategy ddp on one device runs one DDP process (a process group of one, no launcher).
--workload module:function finds module.py in the current folder, as `python -m` would.

--batch-size is the global batch of one optimizer step: it is split over the devices and the
--accumulate micro-steps, so it must be a multiple of devices x accumulate.

Example:
    gpukit train                                  # gpt on the best device
    gpukit train --workload cnn --devices 2 --epochs 1 --out runs/cnn
    gpukit train --workload mlp --max-steps 50 --out runs/mlp --resume
    gpukit train --workload cnn --strategy dp-balanced --devices all
    gpukit train --workload mymod:make            # mymod.py in the current folder
    gpukit train --workload mlp --progress-every 60 | tee train.log
"""

from __future__ import annotations

import argparse
from typing import Any

from gpukit._util.text import make_table
from gpukit.cli._common import add_command, console
from gpukit.diagnostics.memory import MemoryReport
from gpukit.errors import ConfigError
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.loop import (
    DEFAULT_PROGRESS_EVERY,
    RUNTIME_DEFAULTS,
    TrainConfig,
    check,
    fit,
)

NAME = "train"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "train a workload (mlp, cnn, gpt or yours) on one or many devices", __doc__
    )
    parser.add_argument("--workload", default="gpt", help="mlp, cnn, gpt or module:function")
    default = RUNTIME_DEFAULTS
    parser.add_argument(
        "--strategy", default=default["strategy"], help="auto, single, dp, dp-balanced or ddp"
    )
    parser.add_argument(
        "--precision", default=default["precision"], help="auto, 32, bf16-mixed or 16-mixed"
    )
    parser.add_argument(
        "--devices", default=default["devices"], help="auto, all, N, or a list like 0,1"
    )
    parser.add_argument("--epochs", type=int, default=None, help="default: the workload's")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after S optimizer steps")
    parser.add_argument("--batch-size", type=int, default=None, help="global batch per step")
    parser.add_argument("--lr", type=float, default=None, help="default: the workload's")
    parser.add_argument(
        "--accumulate", type=int, default=default["accumulate"], help="micro-steps per step"
    )
    parser.add_argument("--seed", type=int, default=default["seed"])
    parser.add_argument(
        "--log-every", type=int, default=default["log_every"], help="read metrics back every N"
    )
    parser.add_argument(
        "--oom",
        choices=("auto", "recover", "raise"),
        default=default["oom"],
        help="out of memory: auto (recover in one process, stop and explain under several), "
        "recover (re-split the batch and redo the step), raise (stop and explain)",
    )
    parser.add_argument(
        "--progress-every",
        type=float,
        default=DEFAULT_PROGRESS_EVERY,
        metavar="SECONDS",
        help="when stdout is not a terminal: seconds between progress lines "
        f"(default {DEFAULT_PROGRESS_EVERY:g}; 0: after every step)",
    )
    parser.add_argument("--out", default=None, help="folder for metrics, plot and checkpoints")
    parser.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    devices: Any = int(args.devices) if args.devices.isdigit() else args.devices
    for flag in ("epochs", "max_steps", "batch_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: give 1 or more")
    rt = Runtime(
        strategy=args.strategy,
        precision=args.precision,
        devices=devices,
        accumulate=args.accumulate,
        seed=args.seed,
        log_every=args.log_every,
        oom=args.oom,
    )
    config = TrainConfig(
        workload=args.workload,
        epochs=args.epochs,
        max_steps=args.max_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        out=args.out,
        resume=args.resume,
        progress_every=args.progress_every,
    )
    check(config, rt.world_size, rt.accumulate)
    try:
        metrics = rt.launch(fit, config)
    finally:
        # A run in this process (single, dp, or ddp over one device) leaves its models and
        # process group here; the command is done with them.
        rt.teardown()
    _summary(metrics)
    return 0


def _summary(m: dict[str, Any]) -> None:
    out = console()
    mfu = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "- (CPU or unknown GPU peak)"
    rows = [
        ["workload", m["workload"]],
        ["strategy / precision", f"{m['strategy']} x{len(m['devices'])} / {m['precision']}"],
        ["steps (global batch)", f"{m['steps']} ({m['global_batch']})"],
        ["final loss", f"{m['final_loss']:.4f}" if m["final_loss"] is not None else "-"],
        ["throughput", f"{m['samples_per_s']:.1f} samples/s over {m['seconds']:.1f} s"],
        ["MFU", mfu],
    ]
    if m.get("oom_retries"):
        rows.append(
            [
                "out-of-memory retries",
                f"{len(m['oom_retries'])} (micro-batch now {m['micro_batch']})",
            ]
        )
    out.print(make_table("Training summary", ["", ""], rows))
    memory = MemoryReport.from_dict(m["memory"])
    out.print(memory.table("Memory per device"))
    if memory.imbalance is not None:
        out.print(f"imbalance (max/min peak over devices): {memory.imbalance:.2f}x")
    if m.get("sample"):
        out.print("[bold]Sample of generated text:[/]")
        out.print(m["sample"], markup=False, highlight=False)
