"""``gpukit train``'s own options, declared once: :class:`TrainConfig`.

The options that are not the Runtime's settings (those are :mod:`gpukit.runtime.settings`'):
each field carries its default, its flag's help, type, choices and metavar, and who reads it.
From these come the command's flags and so the keys of a ``--config`` file
(:mod:`gpukit.cli.train`), the command line the launcher gives each rank, the ``config`` in
``metrics.json`` (:func:`record`) and the ``config.toml`` that trains a run again
(:mod:`gpukit.train.rerun`). A new option is one more field here.

Who reads an option (its :class:`TrainOption`'s ``reader``):

- ``"loop"``: :func:`gpukit.train.loop.fit`; each rank gets it, ``metrics.json`` records it.
- ``"runtime"``: the command makes the Runtime's keywords or strategy of it; each rank gets it,
  and ``metrics.json`` records what the Runtime made of it (under ``runtime``).
- ``"launcher"``: the launcher that runs the ranks (restarts, hang watch), never a rank.
- ``"command"``: the command itself, before anything starts (``--config``, ``--overwrite``).

>>> [flag_name(f) for f in fields() if option(f).reader == "launcher"]
['--max-restarts', '--hang-timeout', '--startup-timeout', '--straggler-factor', '--straggler-steps']
>>> sorted(record(TrainConfig(workload="mlp", max_restarts=2)))[:4]
['batch_size', 'compile_why', 'epochs', 'lr']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gpukit.runtime.compiling import MODES
from gpukit.runtime.outputs.progress_displays import DEFAULT_EVERY
from gpukit.train.fast import COMPILE_CHOICES, parse_compile

# Seconds between progress lines when stdout is not a terminal
# (gpukit.runtime.outputs.progress_displays).
DEFAULT_PROGRESS_EVERY = DEFAULT_EVERY

Reader = Literal["loop", "runtime", "launcher", "command"]

# The flags that name one mesh of every parallelism dimension (gk.strategies.Parallel's
# keywords): given any, the run trains with Parallel (gpukit.cli._parallel_flags).
MESH_FLAGS = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "pp_schedule", "float8")


@dataclass(frozen=True)
class TrainOption:
    """What a :class:`TrainConfig` field says about itself (see the module docstring)."""

    help: str = ""  # the flag's --help line
    reader: Reader = "loop"
    flag: bool = True  # gpukit train has --name-with-dashes for it (a bool one: a switch)
    parse: Callable[[str], Any] = str  # the flag's text to the value
    choices: tuple[str, ...] | None = None  # the flag's closed set of values
    metavar: str | None = None
    const: str | None = None  # the flag may be given alone: it then means this value
    at_least: int | None = None  # the command refuses a smaller value
    rerun: bool = True  # config.toml repeats it (with the value the run used)
    # config.toml's value: the one the strategy used, its option of this name (where it has one).
    strategy_option: str | None = None


def train_option(default: Any, **meta: Any) -> Any:
    """A :class:`TrainConfig` field: its default and its :class:`TrainOption`."""
    return field(default=default, metadata={"train_option": TrainOption(**meta)})


@dataclass(frozen=True)
class TrainConfig:
    """What ``gpukit train`` was asked to do; None means the workload's default.

    :func:`gpukit.train.loop.fit` reads the ``"loop"`` options; the others are the command's,
    which it turns into the Runtime's keywords, the strategy, or the launcher's settings."""

    workload: str = train_option("gpt", help="mlp, cnn, gpt, gpt2 or module:function")
    config: str | None = train_option(
        None,
        reader="command",
        metavar="FILE",
        help="a TOML file of flags (keys: the long names with underscores, e.g. max_steps = "
        "50); flags given here win over it. --out DIR writes DIR/config.toml, which reruns "
        "the run",
    )
    activation_checkpointing: str | None = train_option(
        None,
        reader="runtime",
        choices=("off", "full", "selective"),
        strategy_option="activation_checkpointing",
        help="fsdp only: recompute each block's activations in the backward (default off)",
    )
    fsdp_mixed: str | None = train_option(
        None,
        reader="runtime",
        choices=("bf16",),
        strategy_option="mixed",
        help="fsdp only: FSDP2's mixed precision, bf16 parameters and compute, fp32 reduction",
    )
    # One mesh of every parallelism dimension (gk.Runtime(parallel=...)): given any of these,
    # the run trains with gk.strategies.Parallel over the sizes given (dp_shard: what is left).
    dp_replicate: int | None = train_option(
        None,
        reader="runtime",
        parse=int,
        metavar="N",
        strategy_option="dp_replicate",
        help="replicas of the sharded model (HSDP), on one mesh with the other dimensions",
    )
    dp_shard: int | None = train_option(
        None,
        reader="runtime",
        parse=int,
        metavar="N",
        strategy_option="dp_shard",
        help="ranks that shard weights, gradients and optimizer state (default: what --tp, "
        "--pp, --cp and --dp-replicate leave)",
    )
    tp: int | None = train_option(
        None,
        reader="runtime",
        parse=int,
        metavar="N",
        strategy_option="tp",
        help="tensor parallel: ranks that split each layer (a plan read off the model)",
    )
    pp: int | None = train_option(
        None,
        reader="runtime",
        parse=int,
        metavar="N",
        strategy_option="pp",
        help="pipeline parallel: stages the model's blocks are split into",
    )
    cp: int | None = train_option(
        None,
        reader="runtime",
        parse=int,
        metavar="N",
        strategy_option="cp",
        help="context parallel: ranks that split each sequence",
    )
    pp_schedule: str | None = train_option(
        None,
        reader="runtime",
        metavar="NAME",
        strategy_option="pp_schedule",
        help="the pipeline's schedule: GPipe, 1F1B (default), Interleaved1F1B, LoopedBFS, "
        "InterleavedZeroBubble, ZBVZeroBubble",
    )
    float8: str | None = train_option(
        None,
        reader="runtime",
        choices=("tensorwise", "rowwise"),
        strategy_option="float8",
        help="float8 matrix products (torchao) on top of bf16-mixed, with this scaling",
    )
    compile: str = train_option(
        "auto",
        reader="runtime",
        parse=parse_compile,
        choices=COMPILE_CHOICES,
        const="on",
        metavar="MODE",
        help="torch.compile the model: auto (on a GPU for a run of 500 steps or more; CUDA "
        "graphs for a small model on one GPU), on (--compile alone), off, or a mode: "
        f"{', '.join(MODES)} (single, ddp: all of it; fsdp: each repeated block; not dp)",
    )
    epochs: int | None = train_option(None, parse=int, at_least=1, help="default: the workload's")
    max_steps: int | None = train_option(
        None, parse=int, at_least=1, help="stop after S optimizer steps"
    )
    # global: samples per optimizer step over all ranks
    batch_size: int | None = train_option(None, parse=int, at_least=1, help="global batch per step")
    lr: float | None = train_option(None, parse=float, help="default: the workload's")
    # The Runtime's seed (its flag is the setting's), which also seeds the workload's data.
    seed: int = train_option(0, flag=False)
    progress_every: float = train_option(
        DEFAULT_PROGRESS_EVERY,
        parse=float,
        metavar="SECONDS",
        help="when stdout is not a terminal: seconds between progress lines "
        f"(default {DEFAULT_PROGRESS_EVERY:g}; 0: after every step)",
    )
    out: str | None = train_option(None, help="folder for metrics, plot and checkpoints")
    # Continue from out's newest checkpoint (restarted attempts always do); a rerun starts anew.
    resume: bool = train_option(False, rerun=False, help="continue from --out's checkpoint")
    progress: bool = train_option(True, flag=False)  # on rank 0 (off when stdout carries JSON)
    logger: str | None = train_option(
        None,
        reader="runtime",
        metavar="NAMES",
        rerun=False,
        help="also log to csv, tensorboard, wandb, mlflow (a comma list), under --out DIR",
    )
    overwrite: bool = train_option(
        False,
        reader="command",
        help="start over in an --out that holds checkpoints (they are moved aside)",
    )
    max_restarts: int = train_option(
        0,
        reader="launcher",
        parse=int,
        at_least=0,
        help="restart every process after a failure, up to K times, resuming from the newest "
        "checkpoint",
    )
    hang_timeout: float | None = train_option(
        None,
        reader="launcher",
        parse=float,
        metavar="SECONDS",
        help="end the run when no rank makes progress for this long, naming the stuck one "
        "(default 300 with several processes or restarts; given for one process, that process "
        "runs under gpukit's launcher, which watches it; 0: never)",
    )
    startup_timeout: float | None = train_option(
        None,
        reader="launcher",
        parse=float,
        metavar="SECONDS",
        help="under gpukit's launcher, end the run when a rank has not begun this long after "
        "its start while another has (default GPUKIT_STARTUP_TIMEOUT, else 900; 0: never)",
    )
    straggler_factor: str = train_option(
        "1.2",
        reader="launcher",
        metavar="X",
        help="under gpukit's launcher, name a rank whose own time per step is over X times "
        "the median rank's (default 1.2)",
    )
    straggler_steps: str = train_option(
        "20",
        reader="launcher",
        metavar="N",
        help="how many of its steps in a row a rank stays that slow before it is named "
        "(default 20; 0: never name one)",
    )
    # What --compile made of this run and why (gpukit.train.fast), for its summary.
    compile_why: str = train_option("", flag=False, rerun=False)
    sample: bool = train_option(True, flag=False)  # generate text at the end, where it can
    # Evaluate the workload's validation set, where it has one.
    validate: bool = train_option(True, flag=False)


def option(f: dataclasses.Field[Any]) -> TrainOption:
    """The :class:`TrainOption` of a :class:`TrainConfig` field."""
    found = f.metadata.get("train_option")
    assert isinstance(found, TrainOption), (
        f"TrainConfig.{f.name} is declared without train_option()"
    )
    return found


def fields() -> tuple[dataclasses.Field[Any], ...]:
    """``gpukit train``'s own options, in the order of its ``--help``."""
    return dataclasses.fields(TrainConfig)


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The option's flag (for those :func:`flags` gives): ``--max-steps`` for ``max_steps``."""
    return "--" + f.name.replace("_", "-")


def is_switch(f: dataclasses.Field[Any]) -> bool:
    """Whether the option's flag takes no value (``--resume``): a bool option's."""
    return isinstance(f.default, bool)


def flags() -> tuple[dataclasses.Field[Any], ...]:
    """The options that have a flag."""
    return tuple(f for f in fields() if option(f).flag)


def for_ranks() -> tuple[dataclasses.Field[Any], ...]:
    """The options each rank of a launched job is given again: the loop's and the Runtime's."""
    return tuple(f for f in flags() if option(f).reader in ("loop", "runtime"))


def for_rerun() -> tuple[dataclasses.Field[Any], ...]:
    """The options ``config.toml`` repeats: what to train (not what to do with a folder)."""
    return tuple(f for f in for_ranks() if option(f).rerun)


def record(config: TrainConfig) -> dict[str, Any]:
    """The loop's options of ``config``, as ``metrics.json``'s ``config`` holds them."""
    return {f.name: getattr(config, f.name) for f in fields() if option(f).reader == "loop"}
