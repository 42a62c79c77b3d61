"""Every setting of a run, declared once: :class:`Settings`.

Each field carries its default, its check, the values it allows, one line of help, whether
``gpukit train`` has a flag for it, and, where ``gpukit train`` uses another default, that
default and why. From these come ``gk.Runtime``'s keywords and their checks, ``gpukit train``'s
flags (:mod:`gpukit.cli._settings`), the ``config`` in ``metrics.json`` (:func:`record`) and
the table in ``docs/settings.md`` (:mod:`gpukit.runtime.settings_doc`). A new option is one
more field here.

>>> Settings(accumulate=2).accumulate
2
>>> Settings(oom="sometimes")
Traceback (most recent call last):
...
gpukit.errors.ConfigError: oom='sometimes': use 'raise' (explain and stop), 'recover' ...
>>> train_defaults()["log_every"], Settings().log_every
(10, 50)
"""

# ruff: noqa: RUF009  (setting() is dataclasses.field() with metadata, not a shared default)
from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpukit.lifecycle.checks import (
    ResumePolicy,
    check_checkpoints,
    check_keep,
    check_needs_folder,
    check_resume,
)
from gpukit.loggers.registry import LoggersSpec, check_loggers
from gpukit.runtime.compiling import GRAPH_MODES, check_compile, check_graph_mode
from gpukit.runtime.data.dealing import DataOrderName
from gpukit.runtime.parallel_setting import check_parallel, check_with_strategy
from gpukit.runtime.schedulers import SchedulerSteps, check_scheduler_steps
from gpukit.runtime.setting_fields import SAME, Option, setting
from gpukit.runtime.settings_checks import (
    DevicesSpec,
    ExportPolicy,
    OomPolicy,
    check_async_save,
    check_batch_dealing,
    check_clip,
    check_count,
    check_data_order,
    check_data_wait,
    check_dealing_options,
    check_export,
    check_init,
    check_nonfinite,
    check_oom,
    check_save_every,
    check_seed,
    parse_count_or_text,
    parse_on_off,
)
from gpukit.runtime.step.nonfinite import NonFinitePolicy
from gpukit.strategies import Strategy


def _count(name: str, meaning: str) -> Callable[[Any], None]:
    return lambda value: check_count(name, value, meaning)


@dataclass(frozen=True)
class Settings:
    """The settings of a run (``gk.Runtime``'s keywords), checked once when made."""

    strategy: str | Strategy = setting(
        "auto",
        help="how the run uses its devices: auto, single, dp, dp-balanced, ddp or fsdp",
        allowed="auto, single, dp, dp-balanced, ddp, fsdp, or a strategy object",
        doc='"auto" (ddp under a launcher or with several devices, or fsdp at rt.setup for a '
        'model the planner says ddp cannot fit; else single), "single", "dp", "dp-balanced", '
        '"ddp", "fsdp", or a strategy object such as ``gk.strategies.DDP(...)`` '
        "(see ``gpukit.strategies``).",
    )
    precision: str = setting(
        "32",
        help="the number format of the step: auto, 32, bf16-mixed or 16-mixed",
        allowed="32, bf16-mixed, 16-mixed, auto",
        doc='"32" (default), "bf16-mixed", "16-mixed" or "auto" (gpukit.runtime.step.precision).',
        train_default="auto",
        why="a command runs as fast as the device allows (auto: bf16-mixed or 16-mixed on a GPU "
        "that has it, 32 on a CPU); a program keeps 32 so that it computes what it did before",
    )
    devices: DevicesSpec = setting(
        "auto",
        help="the devices to train on: auto, all, N, or a list like 0,1",
        allowed="auto, all, N, a spec (cuda:1), a list (0,1)",
        doc='"auto" (the best device), "all" (every GPU), N (N GPUs, or N CPU processes on a '
        'machine without GPUs), a spec such as "cuda:1", or a list of specs; under a launcher, '
        '"cpu" puts every rank it started on the CPU.',
        parse=parse_count_or_text,
    )
    accumulate: int = setting(
        1,
        help="micro-steps per optimizer step",
        allowed="1 or more",
        doc="micro-batches per optimizer step; gradients are averaged over them and DDP "
        "synchronises only on the last one.",
        check=_count("accumulate", "micro-batches per optimizer step"),
        parse=int,
    )
    clip: float | None = setting(
        None,
        help="the max gradient norm to clip to, or None",
        allowed="a positive number, or None",
        doc="max gradient norm, or None.",
        check=check_clip,
        flag=False,
        no_flag="none (the built-in workloads train without clipping)",
    )
    seed: int | None = setting(
        None,
        help="seeds Python, NumPy and torch, and the data order",
        allowed="a signed 64-bit integer, or None",
        doc="seeds Python, NumPy and torch (the same on every rank, so replicas start equal); "
        "also seeds the data order. None: 0 for the data order, RNGs untouched.",
        check=check_seed,
        parse=int,
        train_default=0,
        why="a command's run is repeatable as given; a program's own random generators are left "
        "as it set them",
    )
    log_every: int = setting(
        50,
        help="read metrics back from the device every N rt.log calls",
        allowed="1 or more",
        doc="``rt.log`` reads values back from the device only every this many calls.",
        check=_count("log_every", "rt.log calls between read-backs"),
        parse=int,
        train_default=10,
        why="the command's progress shows the last loss read back, so it reads more often; a "
        "program's loop waits for the device fewer times",
    )
    oom: OomPolicy = setting(
        "raise",
        help="out of memory: auto (recover in one process, stop and explain under several), "
        "recover (re-split the batch and redo the step), raise (stop and explain)",
        allowed="raise, recover, auto",
        doc='what ``rt.train_step`` does when a device runs out of memory: "raise" (an '
        '``OutOfMemory`` error that explains the numbers and what to try), "recover" (cut the '
        "batch into more micro-batches and redo the step; under several processes this costs "
        'DDP its overlap of communication with the backward and one read per step), or "auto" '
        "(recover in one process, where it costs nothing per step; raise under several, or under "
        "a CUDA-graph compile mode). See "
        "``gpukit.runtime.step.stepper``.",
        check=check_oom,
        choices=("auto", "recover", "raise"),
        train_default="auto",
        why="the command recovers where recovery costs nothing per step (one process); a "
        "program's batches are never re-cut unless it asks",
    )
    checkpoints: str | Path | None = setting(
        None,
        help="the folder of this run's checkpoints",
        allowed="a folder, or None",
        doc="the folder of this run's checkpoints: where ``rt.save()`` writes by default, "
        'where ``save_every`` and a preemption save, and where ``resume="auto"`` looks. With '
        "it, SIGTERM and SIGINT stop the run cleanly at a step every rank reaches, after saving "
        "there (``gk.Preempted``; see ``gpukit.lifecycle.preemption``).",
        check=check_checkpoints,
        flag=False,
        no_flag="none: --out DIR keeps them in DIR/checkpoints",
    )
    save_every: int | str | None = setting(
        None,
        help="a checkpoint every N steps, or every TIME (90s, 10m, 1h); needs --out",
        allowed="N steps, a time (90s, 10m, 1h), or None",
        doc='a checkpoint every N optimizer steps (``4``), or every so much time (``"10m"``, '
        '``"90s"``, ``"1h"``); None: only when ``rt.save`` is called.',
        check=check_save_every,
        parse=parse_count_or_text,
        metavar="N|TIME",
    )
    keep: int = setting(
        3,
        help="newest checkpoints kept",
        allowed="1 or more",
        doc="how many of the newest checkpoints to keep.",
        check=check_keep,
        parse=int,
    )
    export: ExportPolicy = setting(
        "every",
        help="fsdp checkpoints: every one also holds the full weights, or never (shards only)",
        allowed="every, never",
        doc="under fsdp, whether each checkpoint also holds the full weights "
        '(``model.safetensors``, gathered one weight at a time): "every", or "never" (the '
        "shards alone, which resume the run; ``rt.save(export=True)`` exports one anyway, "
        "e.g. the last). Without fsdp the weights file is what resumes, and always written.",
        check=check_export,
        choices=("every", "never"),
    )
    resume: ResumePolicy = setting(
        None,
        help="auto: continue from the newest good checkpoint in checkpoints",
        allowed="auto, None",
        doc='"auto": continue from the newest good checkpoint in ``checkpoints`` when there '
        "is one (before the first pass over a loader, step, or forward of a set-up model), else "
        "start fresh.",
        check=check_resume,
        flag=False,
        no_flag="none: --resume continues from --out's newest checkpoint",
    )
    nonfinite: NonFinitePolicy | None = setting(
        None,
        help="NaN/Inf gradients: skip the step on the device, or stop naming it",
        allowed="skip, raise, None",
        doc='None, "skip" (a step with NaN/Inf gradients is skipped on the device; needs an '
        'optimizer built with ``fused=True``) or "raise" (stop naming the step); both read back '
        "only once per ``log_every`` steps (see ``gpukit.runtime.step.nonfinite``).",
        check=check_nonfinite,
        choices=("skip", "raise"),
    )
    scheduler_steps: SchedulerSteps = setting(
        "per-sample",
        help="how a scheduler given to setup steps",
        allowed="per-sample, per-optimizer-step",
        doc='"per-sample" (a scheduler given to ``setup`` follows the samples seen) or '
        '"per-optimizer-step" (see ``gpukit.runtime.schedulers``).',
        check=check_scheduler_steps,
        flag=False,
        no_flag="none (gpukit train's loop has no scheduler)",
    )

    loggers: LoggersSpec = setting(
        None,
        help="where metrics and hyper-parameters go besides rt.history",
        allowed="names (csv, tensorboard, wandb, mlflow), logger objects, or None",
        doc="where rank 0 sends each record ``rt.history`` gains and the hyper-parameters: "
        '``"csv"``, ``"tensorboard"``, ``"wandb"``, ``"mlflow"`` (written under the parent of '
        "``checkpoints``, which they need), logger objects such as "
        '``gk.loggers.TensorBoardLogger("runs/a/tb")``, or one\'s own (see '
        "``gpukit.loggers``); one or a list.",
        flag=False,
        no_flag="--logger csv,tensorboard,wandb,mlflow: written under --out DIR",
    )
    compile: bool | str = setting(
        False,
        help="torch.compile the model: single and ddp (the whole model), fsdp (each block)",
        allowed="False, True, a torch.compile mode, or a backend's name",
        doc="``torch.compile`` the model at ``rt.setup``: True (torch's default backend, "
        'inductor), a mode ("reduce-overhead": CUDA graphs, for a small model on one GPU; '
        '"max-autotune", "max-autotune-no-cudagraphs", "default") or a backend\'s name '
        '("aot_eager"). Under single and ddp the whole model '
        "(DDP's wrapper included, as torch recommends), under fsdp each repeated block before "
        "it is sharded; dp and dp-balanced refuse it. Parameter names and checkpoints are an "
        "uncompiled run's (see ``gpukit.runtime.compiling``).",
        check=check_compile,
        flag=False,
        no_flag="--compile auto|on|off|MODE (auto: compiled on a GPU for 500 steps or more)",
    )

    init: Callable[[Any], Any] | None = setting(
        None,
        help="how a model built on the meta device is initialised: fn(module) per module",
        allowed="a function taking a module, or None",
        doc="a model built under ``torch.device('meta')`` is materialised at ``rt.setup`` "
        "(under fsdp: only each rank's shards) and initialised by ``init(module)`` for each "
        "module holding tensors of its own, or, with None, by each module's "
        "``reset_parameters()`` (a root's ``init_weights()`` when it has one); the same "
        "weights for any rank count (see ``gpukit.strategies.meta_init``).",
        check=check_init,
        flag=False,
        no_flag="none (the built-in workloads are built with their weights)",
    )
    async_save: bool = setting(
        False,
        help="checkpoints written in the background while training goes on",
        allowed="True, False",
        doc="True: ``rt.save`` and ``save_every`` do their collective part and copy what they "
        "save to host memory (pinned on a GPU), then a thread writes, fsyncs and publishes the "
        "files, in the same format, while training goes on. A save waits for the one before "
        "(saying how long); a failed write raises its ``CheckpointWriteError`` at the next "
        "save, load or the end of the run, on every rank; a preemption's save is synchronous; "
        "the end of the run waits for the write. Under fsdp every rank copies its shards and "
        "writes them on a thread of its own. False: every save returns once its files are in "
        "place.",
        check=check_async_save,
        parse=parse_on_off,
        metavar="on|off",
        train_default=True,
        why="a training command's checkpoints should cost it a copy, not the write; a "
        "program keeps the synchronous saves it was written against",
    )
    data_wait: bool = setting(
        False,
        help="measure how long the steps wait for their batches (data_wait in the history)",
        allowed="True, False",
        doc="True: the loaders ``rt.setup`` wraps time each wait for a batch (the host's clock "
        "around the loader's ``next()``; on CUDA also events on the device's stream, read "
        "where the run reads back anyway), each ``rt.history`` record (and so each logger) "
        "gets ``data_wait`` and ``data_wait_fraction`` for its window, and one warning names "
        "the loader's settings to change when the steps wait more than 5% of the time (see "
        "``gpukit.runtime.data.wait``). False: nothing is measured, the records hold what the "
        "program logged.",
        check=check_data_wait,
        parse=parse_on_off,
        metavar="on|off",
        train_default=True,
        why="a training command reports what slows it; a program's records and loggers hold "
        "what it logs",
    )

    data_order: DataOrderName = setting(
        "torch",
        help="batches per rank: torch (a DistributedSampler seeded by seed) or accelerate's",
        allowed="torch, accelerate",
        check=check_data_order,
    )
    even_batches: bool | None = setting(
        None,
        help="data_order=accelerate: pad the last round from the pass's start (None: on)",
        allowed="True, False, None (True)",
        check=check_batch_dealing("even_batches"),
        parse=parse_on_off,
        metavar="on|off",
    )
    split_batches: bool | None = setting(
        None,
        help="data_order=accelerate: cut each batch into one piece per rank (None: off)",
        allowed="True, False, None (False)",
        check=check_batch_dealing("split_batches"),
        parse=parse_on_off,
        metavar="on|off",
    )
    parallel: dict[str, Any] | str | None = setting(
        None,
        help="one mesh of every parallelism dimension: its sizes, or auto",
        allowed='a dict of sizes (dp_replicate, dp_shard, tp, pp, cp), "auto", or None',
        doc="one device mesh of every parallelism dimension (``gpukit.strategies.mesh``): a dict "
        'such as ``{"tp": 2, "pp": 2}`` of the sizes of dp_replicate, dp_shard, tp, pp and cp '
        "(one may be -1: what the others leave; dp_shard is -1 unless given), with the "
        'strategy\'s other keywords (pp_schedule, float8...); or "auto" (the planner chooses '
        "the layout for the model at rt.setup). None: ``strategy`` alone decides.",
        check=check_parallel,
        flag=False,
        no_flag="--dp-replicate, --dp-shard, --tp, --pp, --cp, --pp-schedule, --float8",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check = option(f).check
            if check is not None:
                check(getattr(self, f.name))
        check_needs_folder(self)
        check_loggers(self.loggers, run_folder(self.checkpoints))
        check_graph_mode(self.compile, self.accumulate, self.oom)
        check_dealing_options(self.data_order, self.even_batches, self.split_batches)
        check_with_strategy(self.parallel, self.strategy)

    def recovers(self, distributed: bool) -> bool:
        """Whether out-of-memory errors are recovered for a run that is ``distributed`` or not:
        "auto" recovers only where it costs nothing per step (one process, and no CUDA-graph
        compile mode, where a cut batch would record graphs for its new shapes)."""
        graphs = self.compile in GRAPH_MODES
        return self.oom == "recover" or (self.oom == "auto" and not distributed and not graphs)

    def keywords(self) -> dict[str, Any]:
        """The settings as keyword arguments (``gk.Runtime(**s.keywords())`` makes them
        again)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def run_folder(checkpoints: str | Path | None) -> Path | None:
    """The run's folder, where named loggers write: the parent of its ``checkpoints`` folder
    (None without one).

    >>> run_folder("runs/a/checkpoints").as_posix()
    'runs/a'
    """
    return None if checkpoints is None else Path(checkpoints).parent


def option(f: dataclasses.Field[Any]) -> Option:
    """The :class:`Option` of a :class:`Settings` field."""
    found = f.metadata.get("option")
    assert isinstance(found, Option), f"Settings.{f.name} is declared without setting()"
    return found


def fields(cls: type[Settings] = Settings) -> tuple[dataclasses.Field[Any], ...]:
    """The settings of ``cls`` (a subclass may add some), in their order."""
    return dataclasses.fields(cls)


def flag_name(f: dataclasses.Field[Any]) -> str | None:
    """``gpukit train``'s flag for a setting, or None where it has none."""
    return "--" + f.name.replace("_", "-") if option(f).flag else None


def train_default(f: dataclasses.Field[Any]) -> Any:
    """The value ``gpukit train`` gives a setting when its flag is not given."""
    meta = option(f)
    return f.default if meta.train_default is SAME else meta.train_default


def train_defaults(cls: type[Settings] = Settings) -> dict[str, Any]:
    """The keywords ``gpukit train`` gives ``gk.Runtime`` for the settings it has flags for,
    when given none of them."""
    return {f.name: train_default(f) for f in fields(cls) if option(f).flag}


def record(settings: Settings, strategy: str | None = None) -> dict[str, Any]:
    """Every setting of ``settings``, as ``metrics.json`` holds them: ``strategy`` (the one the
    Runtime chose, the same in every process of a launched job) in place of the one asked for,
    paths and devices as text.

    >>> record(Settings(seed=3), strategy="single")["seed"]
    3
    """
    out = {f.name: _plain(getattr(settings, f.name)) for f in fields(type(settings))}
    if strategy is not None:
        out["strategy"] = strategy
    return out


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return str(value)


def arguments_doc(cls: type[Settings] = Settings, indent: int = 0) -> str:
    """An ``Args:`` section describing every setting, for ``gk.Runtime``'s docstring."""
    pad = " " * indent
    lines = [f"{pad}Args:"]
    for f in fields(cls):
        text = f"{f.name}: {option(f).doc or option(f).help}"
        lines += textwrap.wrap(
            text, 96 - indent, initial_indent=pad + "    ", subsequent_indent=pad + "        "
        )
    return "\n".join(lines) + "\n"
