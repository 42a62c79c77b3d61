"""gpukit train: train a built-in or your own workload on every device, with the same loop.

Workloads: mlp, cnn, gpt (character-level transformer on bundled public-domain text, default), gpt2
(GPT-2 small as nanoGPT trains it: 124M parameters, for a GPU), or package.module:function
returning a Workload or (model, dataset, loss). With more than one device, one DDP process per
device is started, or an fsdp one where the planner says ddp cannot fit the model (--strategy fsdp:
always sharded; dp or dp-balanced: one process drives them all). Rank 0 shows a progress bar (loss,
samples/s, ETA); when stdout is not a terminal (CI, a pipe, a file) it prints a plain line
instead (steps, epoch, loss, samples/s, ETA) every --progress-every SECONDS (default 30; 0:
after every step) and at the start and end of each epoch. The loss shown is the last one read
back (--log-every): showing progress never makes the host wait for the device. At the end: a
summary with throughput, the time spent waiting for data, MFU on GPUs, and memory per device
with the imbalance between devices (max/min peak). When the steps wait for their batches more
than 5% of the time, it warns once, naming the DataLoader settings to change.

When a device runs out of memory in a single-process run, the step is redone with the batch cut
into more micro-batches (--oom auto, the default: recovery costs nothing per step there); under
DDP the run stops with an explanation, since recovering there costs DDP its overlap of
communication with the backward (--oom recover: recover anyway; --oom raise: always stop and
explain). The explanation ends with the planner's figures for this run and for its remedies
(a smaller micro-batch with more accumulation, bf16, fsdp, activation checkpointing): each
one's peak per device and whether it fits the device that ran out.

Each built-in workload has a held-out validation set (never trained on), evaluated at the end
of every epoch and where --max-steps stops the run, over every rank's share with each sample
counted once: val_loss, and val_accuracy for mlp and cnn.

With --out DIR: DIR/metrics.json (with final_val_loss and every value the run used),
DIR/metrics.csv (columns step, epoch, elapsed, lr, loss, val_accuracy, val_loss, data_wait,
data_wait_fraction: a row per read-back, written as they come, and one per validation pass;
data_wait: the seconds the steps of the row's window waited for their batches), DIR/loss.png
(training and validation loss), DIR/report.html (the whole run on one page, written at the end of
every run, failed or stopped too: see gpukit report), DIR/config.toml (every flag as the run used
it: --config DIR/config.toml trains the same run again) and DIR/checkpoints/ (one per epoch, and
every --save-every N steps or time such as 10m; the newest --keep kept; written in the background
while training goes on, --async-save off waits for each). DIR is checked before anything starts: a
folder that already holds checkpoints is refused unless --resume (continue) or --overwrite (start
over; the old checkpoints are moved aside, not deleted). --resume continues from the newest good
checkpoint exactly where it stopped, appends to metrics.csv (dropping rows for steps after that
checkpoint, which a run that died had logged) and draws loss.png from the whole run. A run already
complete (its checkpoint at the last step asked for) says so and exits 0, changing nothing: raise
--max-steps or --epochs to train further, or --overwrite to start over.
--logger tensorboard,wandb,mlflow also writes DIR/tensorboard/, DIR/wandb/ (offline without
WANDB_API_KEY), DIR/mlruns/ (csv: DIR/metrics.csv itself; see docs/loggers.md).

Reliability: --max-restarts K restarts every process after a failure (a fresh port each time)
and the run goes on from its newest checkpoint, as if uninterrupted; --hang-timeout S ends a
run whose processes stop making progress for S seconds, naming the stuck rank and its line
(given for a one-process run, that process runs under the launcher, which watches it), and
--startup-timeout S (default 900) one whose process has not begun S seconds after its start;
SIGTERM or Ctrl-C, to this command or to any of its processes, finishes the current step on
every rank, saves, and exits 143, never restarted (copies of the signal count once; a second
Ctrl-C 2 s or more later exits at once; GPUKIT_STOP_GRACE, default 25 s, bounds the wait);
--nonfinite skip|raise guards against NaN/Inf gradients.

--strategy fsdp shards every weight, gradient and optimizer state over the processes (each
repeated block is one group, gathered only while it computes; the plan is printed at the
start); --activation-checkpointing full|selective recomputes each block's activations in the
backward instead of keeping them (it needs --strategy fsdp); --fsdp-mixed bf16 is FSDP2's mixed
precision (bf16 parameters and compute, gradients reduced in float32, as large-model recipes
train), beside --precision. A --workload whose model is on the meta device is materialised by
the strategy (fsdp: each rank's shards only) and initialised by its modules' reset_parameters().

--compile runs the model under torch.compile: the whole model under single and ddp (DDP's
wrapper included, so gradients are still averaged during the backward), each repeated block
under fsdp; dp and dp-balanced refuse it (they copy the model onto the devices every step).
The first steps are slower while it compiles; checkpoints are the same as without it.
--compile takes auto (the default: on a GPU, compiled from 500 steps, with CUDA graphs for a
model of up to 20M parameters on one GPU; eager on a CPU), on (--compile alone), off, or a
torch.compile mode (default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs).
On a GPU it also turns on TF32 matmuls and fused AdamW; the summary says what it used.

--strategy ddp on one device runs one DDP process (a process group of one, no launcher).
--workload module:function finds module.py in the current folder, as `python -m` would.

--config FILE reads flags from a TOML file, keyed by their long names with underscores
(max_steps = 50, resume = true); flags on the command line win over it.

--batch-size is the global batch of one optimizer step: it is split over the devices and the
--accumulate micro-steps, so it must be a multiple of devices x accumulate.

Example:
    gpukit train                                  # gpt on the best device
    gpukit train --workload cnn --devices 2 --epochs 1 --out runs/cnn
    gpukit train --workload mlp --max-steps 50 --out runs/mlp --resume
    gpukit train --workload cnn --strategy dp-balanced --devices all
    gpukit train --workload mymod:make            # mymod.py in the current folder
    gpukit train --workload mlp --progress-every 60 | tee train.log
    gpukit train --devices 2 --out runs/gpt --save-every 10m --max-restarts 3
    gpukit train --devices 2 --strategy fsdp --activation-checkpointing selective
    gpukit train --workload cnn --devices 2 --compile
    gpukit train --config run.toml --max-steps 100    # run.toml's flags, --max-steps over it
    gpukit train --config runs/mlp/config.toml --out runs/again   # the same run again
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit._util import placement
from gpukit._util.text import format_bytes, make_table
from gpukit.checkpoint.files import resumable, step_of
from gpukit.cli._common import add_command, console
from gpukit.cli._parallel_flags import parallel_setting
from gpukit.cli._settings import add_setting_flags, command_line, values
from gpukit.diagnostics.memory import MemoryReport
from gpukit.diagnostics.oom import explain
from gpukit.diagnostics.oom_message import is_oom
from gpukit.errors import ConfigError, OutOfMemory, RunComplete
from gpukit.launch import _launched_script, run_job, watch_settings
from gpukit.planning.remedies import with_figures
from gpukit.runtime.runtime import Runtime
from gpukit.runtime.settings_checks import resolve_devices
from gpukit.strategies import FSDP
from gpukit.train import options
from gpukit.train.fast import Compile, compile_choice
from gpukit.train.loggers import train_loggers
from gpukit.train.loop import check, fit, planned
from gpukit.train.options import TrainConfig
from gpukit.train.outdir import check_out, claim_out
from gpukit.watch.report import RunEnd, write_quietly
from gpukit.watch.run_records import Ended
from gpukit.workloads.base import load_workload

NAME = "train"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "train a workload (mlp, cnn, gpt, gpt2 or yours) on one or many devices", __doc__
    )
    # gpukit train's own options (--workload, --max-steps, --out, ...): from their one
    # declaration, gpukit.train.options.
    for f in options.flags():
        meta = options.option(f)
        if options.is_switch(f):
            parser.add_argument(options.flag_name(f), action="store_true", help=meta.help)
            continue
        alone: dict[str, Any] = {}
        if meta.const is not None:  # given alone, the flag means this value
            alone = {"nargs": "?", "const": meta.const}
        parser.add_argument(
            options.flag_name(f),
            type=meta.parse,
            choices=meta.choices,
            default=f.default,
            metavar=meta.metavar,
            help=meta.help,
            **alone,
        )
    # The run's settings (--strategy, --precision, --devices, --accumulate, --seed, ...): from
    # their one declaration, gpukit.runtime.settings.
    add_setting_flags(parser)
    parser.set_defaults(run=run, config_parser=parser)  # config_parser: for --config


def run(args: argparse.Namespace) -> int:
    # One run per --out: the folder is locked before anything is written there, by this
    # process (the launcher, when it starts the ranks; the ranks then hold its checkpoints).
    worker = _env.job_dir() is not None  # one process of a job gpukit's launcher started
    lock = None if worker else claim_out(args.out)
    outcome = RunEnd()
    try:
        code = _run(args, worker, outcome)
        outcome.ended = Ended.of_code(code)
        return code
    except BaseException as err:
        outcome.ended = Ended.of_error(err)
        raise
    finally:
        # The run's page: by this process (the launcher, which has the whole job's records),
        # never by a rank; a request refused before training leaves the folder as it was.
        if args.out and outcome.began and not worker:
            write_quietly(args.out, outcome.ended)
        if lock is not None:
            lock.release()


def _run(args: argparse.Namespace, worker: bool, outcome: RunEnd) -> int:
    counts = [(f.name, options.option(f).at_least) for f in options.flags()]
    for name, least in [*counts, ("keep", 1)]:  # --keep: the Runtime's, checked here too
        value = getattr(args, name)
        if least is not None and value is not None and value < least:
            raise ConfigError(f"--{name.replace('_', '-')} {value}: give {least} or more")
    if args.hang_timeout is not None and not 0 <= args.hang_timeout < float("inf"):
        raise ConfigError(
            f"--hang-timeout {args.hang_timeout}: give seconds, 0 or more (0: never end a run "
            "for a hang)"
        )
    if args.startup_timeout is not None and not 0 <= args.startup_timeout < float("inf"):
        raise ConfigError(
            f"--startup-timeout {args.startup_timeout}: give seconds, 0 or more (0: never end "
            "a run whose rank does not begin)"
        )
    recording = watch_settings(args.out, args.straggler_factor, args.straggler_steps)
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite contradict: continue, or start over")
    if args.overwrite and not args.out:
        raise ConfigError(
            "--overwrite needs --out DIR: it starts over in DIR, moving its checkpoints aside"
        )
    checkpoints = Path(args.out) / "checkpoints" if args.out else None
    if args.save_every is not None and checkpoints is None:
        raise ConfigError("--save-every needs --out DIR: the checkpoints go in DIR/checkpoints")
    # The settings without a flag keep gk.Runtime's defaults, but checkpoints: under --out.
    loggers = train_loggers(args.logger, args.out)
    asked = {f.name: getattr(args, f.name) for f in options.flags()}
    compiled = _compile_choice(args, TrainConfig(**asked, seed=args.seed))
    parallel = parallel_setting(args)
    chosen = {
        # {} (--strategy parallel alone) is a layout too: every rank sharding.
        "strategy": "auto" if parallel is not None else _strategy(args),
        "parallel": parallel,
        "checkpoints": checkpoints,
        "compile": compiled.setting,
    }
    rt = Runtime(**{**values(args), **chosen}, loggers=loggers)
    config = TrainConfig(**asked, seed=args.seed, compile_why=compiled.why)
    oom: tuple[BaseException, dict[str, Any] | None] | None = None
    try:
        # Split over the ranks that read different samples: tensor and context ranks share.
        check(config, rt.strategy.sampler_placement()[0], rt.accumulate)
        if not worker:  # the launcher checked it before starting this process
            check_out(args.out, resume=args.resume, overwrite=args.overwrite)
        # A hang watch needs the launcher too, even for one process: it is what watches.
        watched = bool(args.max_restarts or args.hang_timeout)
        if watched and rt.strategy.traits.drives_all_devices and not worker:
            raise ConfigError(
                f"--max-restarts and --hang-timeout run the processes under gpukit's launcher, "
                f"but --strategy {rt.strategy.name} drives every device from one process, "
                "which cannot run there: use --strategy ddp (one process per device), or drop "
                "--max-restarts and --hang-timeout"
            )
        if not worker and parallel is not None:
            # A layout the model cannot take (heads or blocks that do not divide) is said here,
            # before any rank starts: the workload is built on the meta device. A sequence
            # the context ranks cannot split is said by the ranks, at their first batch.
            rt.strategy.check_model(load_workload(args.workload, seed=args.seed, meta=True).model)
        if not worker and (rt.strategy.needs_launch or watched):
            # gpukit's launcher runs the processes (and restarts them, watching for hangs);
            # each runs this command again as one rank of the job.
            nproc, strategy = rt.world_size, rt.strategy.name
            if args.strategy == "auto" and strategy == "ddp":
                strategy = "auto"  # each rank may still take fsdp for a model ddp cannot fit
            rt.teardown()
            outcome.began = True
            return run_job(
                _worker_command(args, strategy),
                nproc,
                max_restarts=args.max_restarts,
                hang_timeout=args.hang_timeout,
                startup_timeout=args.startup_timeout,
                name="gpukit train",
                total_steps=planned(config)[0],
                **recording,
            )
        outcome.began = True
        metrics = rt.launch(fit, config)
    except RunComplete as done:  # --resume with nothing left to train: said, not an error
        outcome.began = False  # nothing trained: the folder is left as it was
        if rt.rank == 0:
            console().print(str(done), markup=False, highlight=False)
        return 0
    except Exception as err:
        if not is_oom(err):
            raise
        # Explained after the teardown: the planner simulates in a process group of its own.
        oom = (err, _run_settings(args, rt))
    finally:
        # A run in this process (single, dp, or ddp over one device) leaves its models and
        # process group here; the command is done with them.
        rt.teardown()
    if oom is not None:
        failed, settings = oom
        cause = failed.__cause__ if isinstance(failed, OutOfMemory) else failed
        raise _out_of_memory(failed, settings) from cause
    if metrics:  # rank 0's; the other ranks of a launched job return nothing
        _summary(metrics)
    return 0


def _compile_choice(args: argparse.Namespace, config: TrainConfig) -> Compile:
    """What ``--compile`` makes of this run (gpukit.train.fast): auto looks at the devices it
    trains on and, on GPUs, at how many steps it takes of how large a model."""
    launched = placement.launched()
    devices = resolve_devices(values(args)["devices"], launched is not None)
    cuda = all(d.type == "cuda" for d in devices)
    steps = parameters = 0
    if args.compile == "auto" and cuda:  # the workload is loaded only where it decides
        steps, parameters = planned(config)
        steps -= _resumed_at(args)  # a resumed run weighs the steps it has left
    count = launched.world_size if launched else len(devices)
    return compile_choice(
        args.compile,
        cuda=cuda,
        strategy=args.strategy,
        devices=count,
        steps=steps,
        parameters=parameters,
        fixed_shapes=args.accumulate == 1 and args.oom != "recover",
    )


def _resumed_at(args: argparse.Namespace) -> int:
    """The step a resumed run goes on from: its newest good checkpoint's (0 for a new run,
    or where there is none to resume yet; a bad one is the load's to explain)."""
    if not args.out or not (args.resume or _env.attempt() > 0):
        return 0
    with warnings.catch_warnings():  # the load itself warns, once, about a fallback
        warnings.simplefilter("ignore")
        try:
            found = resumable(Path(args.out) / "checkpoints")
        except ConfigError:
            return 0
    return (step_of(found) or 0) if found is not None else 0


def _run_settings(args: argparse.Namespace, rt: Runtime) -> dict[str, Any] | None:
    """The run as the planner is asked about it (read before the Runtime is torn down); None
    if it cannot be read, which must not hide the error being explained, or if the planner's
    what-ifs do not model it (FSDP2's mixed precision: figures for another run would mislead)."""
    if args.fsdp_mixed is not None:
        return None
    try:
        return {
            "workload": args.workload,
            "batch": args.batch_size,
            # Every device the run used: one per process, or all of them from one process (dp).
            "devices": max(rt.world_size, len(rt.strategy.driven_devices)),
            "strategy": rt.strategy.name,
            "accumulate": rt.accumulate,
            "precision": rt.precision.name,
            "activation_checkpointing": args.activation_checkpointing or "off",
        }
    except Exception:
        return None


def _out_of_memory(err: BaseException, settings: dict[str, Any] | None) -> OutOfMemory:
    """The error to stop with: the explanation of ``err`` (the Runtime's, or gpukit.explain's
    for an error outside a training step), then the planner's figures for what would fit."""
    explanation = str(err) if isinstance(err, OutOfMemory) else str(explain(err))
    if settings is None:
        return OutOfMemory(explanation)
    return OutOfMemory(with_figures(explanation, err, **settings))


def _strategy(args: argparse.Namespace) -> Any:
    """``--strategy``, with fsdp's own flag; a usage error when it comes with another one.
    (``--compile`` is the Runtime's, for every strategy that can compile.)"""
    if args.strategy != FSDP.name:
        if args.activation_checkpointing is not None:
            raise ConfigError(
                "--activation-checkpointing: only --strategy fsdp recomputes its blocks, but "
                f"--strategy is {args.strategy!r}: add --strategy fsdp, or drop "
                "--activation-checkpointing"
            )
        if args.fsdp_mixed is not None:
            raise ConfigError(
                f"--fsdp-mixed {args.fsdp_mixed}: FSDP2's mixed precision needs --strategy fsdp, "
                f"but --strategy is {args.strategy!r}: add --strategy fsdp, or use --precision "
                "bf16-mixed instead"
            )
        return args.strategy
    return FSDP(
        activation_checkpointing=args.activation_checkpointing or "off", mixed=args.fsdp_mixed
    )


def _worker_command(args: argparse.Namespace, strategy: str) -> list[str]:
    """This command line for one rank of the job: the same training, with the strategy the
    launcher resolved (a launched process would otherwise pick ddp even for one device)."""
    # Through the runner that records how a process failed (with a nanosecond clock) and
    # writes its stack when the launcher asks, as gpukit launch runs scripts.
    runner = [sys.executable, str(Path(_launched_script.__file__))]
    command = [*runner, "-m", "gpukit", "train", "--strategy", strategy]
    command += command_line(args, skip=("strategy",))
    for f in options.for_ranks():
        value = getattr(args, f.name)
        if options.is_switch(f):
            command += [options.flag_name(f)] if value else []
        elif value is not None:
            command += [options.flag_name(f), str(value)]
    return command


def _waited(m: dict[str, Any]) -> str:
    """The summary's row of how long the steps waited for their batches.

    >>> _waited({"data_wait": 0.5, "data_wait_fraction": 0.04, "data_wait_device": 0.3})
    '0.50 s (4.0% of the time); the GPU waited 0.30 s for copies'
    """
    shown = f"{m['data_wait']:.2f} s"
    if m.get("data_wait_fraction") is not None:
        shown += f" ({m['data_wait_fraction']:.1%} of the time)"
    if m.get("data_wait_device") is not None:
        shown += f"; the GPU waited {m['data_wait_device']:.2f} s for copies"
    return shown


def _summary(m: dict[str, Any]) -> None:
    out = console()
    mfu = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "- (CPU or unknown GPU peak)"
    rows = [
        ["workload", m["workload"] + (f" ({m['data']})" if m.get("data") else "")],
        ["strategy / precision", f"{m['strategy']} x{len(m['devices'])} / {m['precision']}"],
        ["steps (global batch)", f"{m['steps']} ({m['global_batch']})"],
        ["final loss", f"{m['final_loss']:.4f}" if m["final_loss"] is not None else "-"],
    ]
    if m.get("final_val_loss") is not None:  # the last validation pass
        accuracy = m.get("final_val_accuracy")
        shown = f"{m['final_val_loss']:.4f}" + (f" (accuracy {accuracy:.1%})" if accuracy else "")
        rows.append(["validation loss", shown])
    rows += [
        ["throughput", f"{m['samples_per_s']:.1f} samples/s over {m['seconds']:.1f} s"],
        ["MFU", mfu],
    ]
    if m.get("data_wait") is not None:
        rows.insert(-1, ["waiting for data", _waited(m)])
    chosen = m.get("fast") or {}
    if chosen.get("tf32") or chosen.get("compile", {}).get("used"):  # a GPU's, or asked for
        rows.append(["torch.compile", chosen["compile"]["why"]])
        kernels = [
            k for k, on in (("TF32", chosen["tf32"]), ("fused AdamW", chosen["fused_adamw"])) if on
        ]
        if kernels:
            rows.append(["GPU kernels", ", ".join(kernels)])
    if m.get("model_state"):  # weights + gradients + optimizer state, as each rank holds them
        held = ", ".join(format_bytes(b) for b in m["model_state"])
        rows.append(["model state per rank", held])
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
