r"""gpukit plan: each device's peak memory and the step time, per strategy and device count,
predicted before running, and the plan to run.

For every strategy and device count: the largest device's peak (and the first device's, where
dp gathers outputs), what it is made of, the step time split into compute, exposed
communication and host overhead, samples/s, MFU, whether it fits, the largest micro-batch that
fits, and a recommendation. single, ddp and fsdp are simulated (gpukit's own training code
over fake tensors, one rank standing for N, in this process: exact on this machine's CPU);
dp and dp-balanced use the closed form. --target names the GPU to plan for (default: this
machine's first GPU, else its CPU); --memory overrides its size. --calibrate first measures a
few real steps on this machine's device (memory overheads, seconds per sample), and trains each
strategy asked on each device count this machine has (ddp and fsdp as gloo processes on a CPU)
for its step time; without it the step time is a datasheet estimate, and the output says so.

Example:
    gpukit plan --workload gpt --devices 1,2,8 --strategies single,ddp,fsdp
    gpukit plan --workload gpt --devices 64 --target h100 --batch-size 512 --json
    gpukit plan --workload mypkg.train:make --devices 4 --target a100-40gb \
        --activation-checkpointing selective
    # a meta-device 8B model, planned without materialising it:
    gpukit plan --workload gpukit.workloads.llama:llama3_8b --devices 8,128 --target h100 \
        --strategies ddp,fsdp --fsdp-mixed bf16

Layouts of data, tensor, pipeline and context parallelism (a Llama-style decoder, closed
form): --layout auto searches every valid dp_replicate x dp_shard x tp x pp x cp of one GPU
count for the fastest that fits; any of --dp-shard, --dp-replicate, --tp, --pp, --cp plans
that one layout (the sizes left out are 1, and --dp-shard what the others leave of
--devices, as gpukit train takes them). Activation checkpointing defaults to full there,
and --target to h100.
    gpukit plan --workload gpukit.workloads.llama:llama3_405b --devices 512 --batch-size 256 \
        --layout auto --float8 tensorwise
    gpukit plan --workload gpukit.workloads.llama:llama3_70b --devices 256 --batch-size 512 \
        --tp 8 --dp-shard 32 --float8 tensorwise --async-tp
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.errors import ConfigError
from gpukit.planning import registered
from gpukit.planning.arguments import CHECKPOINTING, PRECISIONS
from gpukit.planning.closed_form import MIXED
from gpukit.planning.layout_search import plan_layout
from gpukit.planning.layouts import DEGREES, FLOAT8, SCHEDULES
from gpukit.planning.planner import plan
from gpukit.planning.targets import parse_bytes, target
from gpukit.strategies import STRATEGIES

NAME = "plan"
DEGREE_HELP = (
    "replicas of the shards (HSDP)",
    "FSDP shards",
    "tensor parallel (within a node)",
    "pipeline stages",
    "context parallel (sequence)",
)


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "predict memory and step time per strategy and GPU count", __doc__
    )
    add_json_flag(parser)
    parser.add_argument("--workload", default="gpt", help="mlp, cnn, gpt, gpt2 or module:function")
    parser.add_argument(
        "--devices", default=None, help="device counts, comma-separated (default: 1,2)"
    )
    parser.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated among {','.join(STRATEGIES)} (default: all that apply)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="global batch size")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument(
        "--activation-checkpointing",
        default=None,
        choices=CHECKPOINTING,
        help="default: off (full with a layout)",
    )
    parser.add_argument(
        "--fsdp-mixed",
        default=None,
        choices=MIXED,
        help="plan fsdp with FSDP2 mixed precision: bf16 params and compute, fp32 reduction",
    )
    parser.add_argument("--target", default=None, help="a GPU name (h100, a100-40gb), or cpu")
    parser.add_argument("--memory", default=None, help="memory per device, e.g. 24GiB")
    parser.add_argument(
        "--method",
        default="auto",
        choices=("auto", "closed-form"),
        help="auto: simulate where possible; closed-form: instant",
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="measure a few steps on this machine first"
    )
    layouts = parser.add_argument_group("layouts (tensor, pipeline, context parallelism)")
    layouts.add_argument("--layout", choices=("auto",), default=None, help="search every layout")
    for degree, meaning in zip(DEGREES, DEGREE_HELP, strict=True):
        flag = f"--{degree.replace('_', '-')}"
        layouts.add_argument(flag, type=int, default=None, metavar="N", help=meaning)
    layouts.add_argument(
        "--pp-schedule",
        default=None,
        choices=tuple(SCHEDULES),
        metavar="NAME",
        help=f"{', '.join(SCHEDULES)} (default 1F1B)",
    )
    layouts.add_argument(
        "--microbatches", type=int, default=None, metavar="N", help="per pipeline step (default pp)"
    )
    layouts.add_argument("--float8", default=None, choices=FLOAT8)
    layouts.add_argument("--async-tp", action="store_true", help="overlap TP's collectives")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.layout or any(getattr(args, d) is not None for d in DEGREES):
        return _run_layout(args)
    alone = [
        flag
        for flag, value in (
            ("--pp-schedule", args.pp_schedule),
            ("--microbatches", args.microbatches),
            ("--float8", args.float8),
            ("--async-tp", args.async_tp),
        )
        if value is not None and value is not False
    ]
    if alone:
        raise ConfigError(
            f"{', '.join(alone)} plan layouts: add --layout auto, or the sizes (--tp, --pp, "
            "--cp, --dp-shard, --dp-replicate)"
        )
    if args.activation_checkpointing is None:
        args.activation_checkpointing = "off"
    calibration = None
    counts = _counts(args.devices if args.devices is not None else "1,2")
    names = _names(args.strategies) if args.strategies is not None else None
    if args.calibrate:
        from gpukit.planning.calibrate_runs import calibrate_plan

        here, asked = target(None).name, target(args.target).name
        if asked != here:  # this machine's seconds would be printed as the target's
            raise ConfigError(
                f"--calibrate measures steps on this machine ({here}), but --target is "
                f"{asked}: its step time would be this machine's. Run --calibrate on a "
                f"{asked}, or drop --calibrate for the target's datasheet estimate"
            )

        every = names or list(registered.names())
        cases = [(s, n) for s in every for n in counts]
        calibration = calibrate_plan(
            args.workload,
            cases,
            batch=args.batch_size,
            accumulate=args.accumulate,
            precision=args.precision,
        )
    report = plan(
        args.workload,
        batch=args.batch_size,
        devices=counts,
        strategies=names,
        precision=args.precision,
        accumulate=args.accumulate,
        activation_checkpointing=args.activation_checkpointing,
        target=args.target,
        memory=parse_bytes(args.memory) if args.memory is not None else None,
        method=args.method,
        calibration=calibration,
        fsdp_mixed=args.fsdp_mixed,
    )
    if args.json:
        print_json(report.to_dict())
        return 0
    console().print(str(report), highlight=False, soft_wrap=True)
    return 0


def _run_layout(args: argparse.Namespace) -> int:
    if args.devices is None:
        raise ConfigError(
            "a layout is planned for one GPU count, and --devices was not given: add it "
            "(e.g. --devices 256)"
        )
    counts = _counts(args.devices)
    if len(counts) != 1:
        raise ConfigError(
            f"--devices {args.devices!r} with a layout: give one GPU count (e.g. --devices 256)"
        )
    strays = [
        flag
        for flag, set_ in (
            ("--strategies", args.strategies is not None),
            ("--calibrate", args.calibrate),
            ("--fsdp-mixed", args.fsdp_mixed is not None),
            ("--precision", args.precision != "auto"),
            ("--accumulate", args.accumulate != 1),
            ("--method", args.method != "auto"),
        )
        if set_
    ]
    if strays:
        raise ConfigError(
            f"{', '.join(strays)} plan strategies, not layouts (a layout is planned with bf16 "
            "FSDP2 and AdamW, in closed form, without accumulation): leave them out with "
            "--layout or --tp/--pp/--cp/--dp-shard/--dp-replicate"
        )
    given = {d: getattr(args, d) for d in DEGREES if getattr(args, d) is not None}
    if args.layout and given:
        raise ConfigError(
            f"--layout auto searches every layout, but {', '.join(given)} fixes one: give "
            "either --layout auto or the sizes"
        )
    if args.pp_schedule and (args.layout or (given.get("pp") or 1) == 1):
        raise ConfigError(
            f"--pp-schedule {args.pp_schedule} schedules a pipeline: give --pp above 1 with it "
            "(--layout auto tries every schedule)"
        )
    if args.microbatches is not None and args.layout:
        raise ConfigError(
            f"--microbatches {args.microbatches} splits one pipeline's step, but --layout auto "
            "searches pipelines with micro-batches of one sample: give the sizes with --pp "
            "instead of --layout auto, or leave --microbatches out"
        )
    layout: Any = "auto"
    if not args.layout:
        layout = {d: given.get(d, 1) for d in DEGREES}
        if "dp_shard" not in given:  # as gpukit train: the shards are what the others leave
            others = math.prod(layout.values())
            if counts[0] % others == 0:
                layout["dp_shard"] = counts[0] // others
        if args.pp_schedule:
            layout["pp_schedule"] = args.pp_schedule
        if args.microbatches is not None:
            layout["microbatches"] = args.microbatches
    report = plan_layout(
        args.workload,
        devices=counts[0],
        layout=layout,
        batch=args.batch_size,
        target=args.target if args.target is not None else "h100",
        memory=parse_bytes(args.memory) if args.memory is not None else None,
        activation_checkpointing=args.activation_checkpointing or "full",
        float8=args.float8,
        async_tp=args.async_tp,
    )
    if args.json:
        print_json(report.to_dict())
        return 0
    console().print(str(report), highlight=False, soft_wrap=True)
    return 0


def _names(text: str) -> list[str]:
    parts = [p.strip() for p in str(text).split(",")]
    if not all(parts):
        raise ConfigError(
            f"--strategies {text!r}: give strategy names, comma-separated (e.g. ddp,fsdp), "
            "or leave it out for all that apply"
        )
    return parts


def _counts(text: str) -> list[int]:
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError(
            f"--devices {text!r}: give device counts of at least 1, comma-separated (e.g. 1,2,8)"
        )
    return [int(p) for p in parts]
