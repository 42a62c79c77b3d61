"""Runtime: the one small object a training loop talks to.

It resolves the devices, picks the strategy and the precision, and then delegates: the same
loop runs on one CPU, one GPU, or one process per device under DDP.

>>> import torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu", seed=0)
>>> model = torch.nn.Linear(4, 1)
>>> data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
>>> model, optimizer, loader = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
>>> for x, y in loader:
...     loss = torch.nn.functional.mse_loss(model(x), y)
...     rt.backward(loss)
...     _ = rt.step(optimizer)
...     rt.log(loss=loss)
>>> rt.global_step
2
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader

from gpukit import _env
from gpukit._util.fake import in_real_process_group
from gpukit.checkpoint.live import user_model
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.launch import DEFAULT_HANG_TIMEOUT
from gpukit.launch.faults import OomFault
from gpukit.launch.functions import check_options, launch_function
from gpukit.lifecycle.boundaries import Lifecycle
from gpukit.lifecycle.checks import ResumePolicy
from gpukit.loggers.registry import LoggersSpec
from gpukit.runtime import collectives, owned
from gpukit.runtime.checkpointing import Checkpointing
from gpukit.runtime.compiling import Compiler
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.optimizer_adoption import adopt, parameters
from gpukit.runtime.outputs.evaluation import Evaluation
from gpukit.runtime.outputs.metrics import Metrics
from gpukit.runtime.outputs.profiling import Profiling
from gpukit.runtime.outputs.progress import Progressing
from gpukit.runtime.outputs.reporting import Reporting
from gpukit.runtime.owned import Registry
from gpukit.runtime.properties import RuntimeViews
from gpukit.runtime.schedulers import SchedulerSteps
from gpukit.runtime.settings import ExportPolicy, Settings, arguments_doc
from gpukit.runtime.settings_checks import (
    DevicesSpec,
    OomPolicy,
    check_device_count,
    resolve_devices,
)
from gpukit.runtime.state import TrainState
from gpukit.runtime.step.loss_targets import with_target_check
from gpukit.runtime.step.nonfinite import NonFiniteGuard, NonFinitePolicy
from gpukit.runtime.step.precision import make_precision
from gpukit.runtime.step.snapshot import seed_everything
from gpukit.runtime.step.stepper import Stepper
from gpukit.runtime.strategy_at_setup import AutoChoice
from gpukit.strategies import ReduceOp, Strategy, choose
from gpukit.strategies.meta_init import MetaInit


class Runtime(
    RuntimeViews, Registry, Checkpointing, Evaluation, Reporting, Progressing, Profiling, AutoChoice
):
    """Strategy, precision, accumulation, clipping and logging behind one object.

    Its keywords are the settings declared in :class:`gpukit.runtime.settings.Settings` (the
    table: ``docs/settings.md``), each described below.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        precision: str = "32",
        devices: DevicesSpec = "auto",
        accumulate: int = 1,
        clip: float | None = None,
        seed: int | None = None,
        log_every: int = 50,
        oom: OomPolicy = "raise",
        checkpoints: str | Path | None = None,
        save_every: int | str | None = None,
        keep: int = 3,
        export: ExportPolicy = "every",
        resume: ResumePolicy = None,
        nonfinite: NonFinitePolicy | None = None,
        scheduler_steps: SchedulerSteps = "per-sample",
        loggers: LoggersSpec = None,
        compile: bool | str = False,
        init: Callable[[Any], Any] | None = None,
    ) -> None:
        # Every keyword above by name (tests/runtime/test_runtime_keywords.py: as in Settings).
        arguments = {name: value for name, value in locals().items() if name != "self"}
        self.config = settings = Settings(**arguments)
        launched = _env.launched() is not None
        devices = resolve_devices(settings.devices, launched)
        self.strategy = choose(settings.strategy, devices, launched)
        self.strategy.meta_init = MetaInit(settings.init, settings.seed)  # a meta model's init
        check_device_count(settings.devices, devices, self.strategy)
        self.precision = make_precision(settings.precision, self.strategy.device.torch)
        self.strategy.check_precision(self.precision.name)
        self._compiler = Compiler(settings.compile, self.strategy)
        self.state = TrainState()
        guard = None
        if settings.nonfinite is not None:
            guard = NonFiniteGuard(settings.nonfinite, settings.log_every, self.precision.name)
        self.lifecycle = Lifecycle(
            settings,
            self.rank,
            self.world_size,
            settings.log_every,
            save=self.save,
            # Asked through the strategy held now: strategy="auto" may replace it at rt.setup.
            agree=lambda votes: self.strategy.any_rank(votes),
            store=collectives.default_store,
            resume=self.resume,
            deferrable=lambda: any(loader.in_pass for loader in self.state.loaders),
        )
        self._stepper = Stepper(
            settings,
            self.state,
            self.strategy,
            self.precision,
            OomFault.from_env(self.strategy.device.torch),
            boundaries=self.lifecycle,
            guard=guard,
        )
        self._metrics = Metrics(self.strategy.device.torch, settings.log_every, self.strategy)
        self._init_loggers()
        self._ready = False
        if settings.seed is not None:
            seed_everything(settings.seed)
        if launched and not self.strategy.needs_launch:
            # One rank of a launched job joins its process group now, as Accelerate's
            # constructor does: what the program builds before rt.setup (a
            # DistributedSampler, a barrier around a download) needs it.
            self._ensure_ready()

    # -- setup ----------------------------------------------------------------------------------
    def launch(
        self,
        fn: Callable[..., Any],
        *args: Any,
        max_restarts: int = 0,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    ) -> Any:
        """Run ``fn(runtime, *args)`` on every rank and return rank 0's result.

        Starts one process per device when the strategy needs them and none are running yet,
        watched as ``gpukit launch`` watches its processes (see ``gpukit.launch.functions``):
        a rank with no heartbeat for ``hang_timeout`` seconds is reported hung with its line
        (0: never; None: 300), the first failure is raised, and the ranks are started again up
        to ``max_restarts`` times after a failure past their first step (``resume="auto"``
        resumes them from the newest checkpoint). Otherwise calls ``fn`` here. When ``fn``
        returns, the last logging window is read back (every rank is there).
        """
        check_options(max_restarts, hang_timeout)
        run = functools.partial(_then_close_window, fn)
        if not self.strategy.needs_launch:
            return run(self, *args)
        # Each process builds its own Runtime from the same settings (its rank: from its env).
        settings = self.config.keywords()
        make = functools.partial(Runtime, **settings)
        return launch_function(
            make, self.world_size, run, args, max_restarts=max_restarts, hang_timeout=hang_timeout
        )

    def setup(self, model: nn.Module, *objects: Any) -> Any:
        """Place the model for the strategy and precision; register optimizers, schedulers,
        DataLoaders and objects with a ``state_dict`` (alone or in lists, tuples, dicts) for
        checkpoints, or refuse them (see ``gpukit.runtime.owned``). Returns the model alone, or
        the model and the rest in the same order and shape (DataLoaders and schedulers wrapped).
        The user's module is never changed beyond being moved. Setting up the same model again
        returns what the first call returned."""
        self._ensure_ready()
        self.lifecycle.beat("setup", self.state.global_step)
        user = self.unwrap(model)
        module = next((m for m in self.state.modules if self.unwrap(m) is user), None)
        optimizers = owned.optimizers_in(objects)
        if module is None:
            self._auto_decide(user, objects)  # strategy="auto": fsdp where ddp cannot fit
            before = parameters(user)
            # Autocast inside the strategy's wrapper: DDP calls it as it would call the model,
            # and DDP's own switches (no_sync, buffer broadcast) stay on the outermost module.
            # compile=...: the strategy's result compiled in place (gpukit.runtime.compiling).
            placed = self._compiler.before_strategy(self.precision.setup_module(user), user)
            module = self._compiler.after_strategy(self.strategy.setup_module(placed))
            self.state.modules.append(module)
            # fsdp replaces the parameters: optimizers built before now must follow them.
            self._stepper.stale.note(adopt(before, parameters(self.unwrap(module)), optimizers))
        self.state.optimizers += [
            o for o in optimizers if not any(o is k for k in self.state.optimizers)
        ]
        self._stepper.sync_next_backward()
        out = owned.take_all(objects, self.state, self.setup_loader, self._scheduler)
        return (module, *out) if out else module

    def setup_loader(self, loader: DataLoader[Any]) -> DeviceLoader:
        """Shard, re-seed every epoch, and move batches to the device (see
        ``gpukit.runtime.data.loader``)."""
        self._ensure_ready()
        shards, shard = self.strategy.sampler_placement()
        wrapped = DeviceLoader(
            loader,
            self.device,
            shards,
            shard,
            self.config.seed or 0,
            steps=lambda: self.state.micro_step,
            on_pass_end=self._end_of_pass,
            on_pass_start=self.lifecycle.before_first_pass,
            on_batch=self.lifecycle.at_boundary,
            on_handed=self._batch_handed,
        )
        self.state.loaders.append(wrapped)
        return wrapped

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: Literal["mean", "sum"] | None = None
    ) -> Callable[..., torch.Tensor]:
        """The loss function as the strategy computes it: itself for single, ddp and dp; on
        every device for dp-balanced, where ``reduction`` (default: the loss module's own, else
        "mean") says how to combine the per-device losses. Called the same way everywhere:
        ``criterion(model(x), y)``. For cross-entropy and NLL losses, the first call checks
        that the class targets lie in ``[0, num_classes)`` (a readable error here, rather than
        a device-side assert on a GPU); the loss module itself is returned unchanged."""
        return with_target_check(fn, self.strategy.setup_criterion(fn, reduction))

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside what ``setup`` returned."""
        return user_model(module, self.strategy, self.precision)

    # -- the step -----------------------------------------------------------------------------
    def train_step(
        self,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        compute_loss: Callable[[Any], torch.Tensor],
    ) -> torch.Tensor:
        """One optimizer step over ``batch``: ``compute_loss(micro_batch)`` (the mean loss of
        the samples it is given) on each of ``accumulate`` micro-batches, backward, step.

        When out-of-memory recovery is on (``oom``), an out-of-memory error re-cuts the batch
        into more micro-batches and redoes the step, with the same result. Returns the batch's
        mean loss, on the device (log it with ``rt.log``: reading it here would stall the GPU).

        >>> import torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu", accumulate=2)
        >>> model = torch.nn.Linear(2, 1)
        >>> model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> x, y = torch.ones(6, 2), torch.zeros(6, 1)
        >>> mse = torch.nn.functional.mse_loss
        >>> loss = rt.train_step(opt, (x, y), lambda b: mse(model(b[0]), b[1]))
        >>> rt.global_step
        1
        """
        self._ensure_ready()
        if not self.lifecycle.resumed:
            self.lifecycle.before_first_pass()
        return self._stepper.train_step(optimizer, batch, compute_loss)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass in the run's precision, averaged over accumulated micro-batches."""
        if not self.lifecycle.resumed:
            self.lifecycle.before_first_pass()
        self._stepper.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, clip, step and zero the gradients once every ``accumulate`` calls.

        Returns True when the optimizer stepped (False while accumulating, or when 16-mixed
        skipped a step whose gradients overflowed).
        """
        return self._stepper.step(optimizer)

    def out_of_memory(
        self, err: BaseException | str, micro_batch: int | None = None
    ) -> OutOfMemory:
        """The error to raise for an out-of-memory ``err``: its numbers, explained with what
        this run knows (weights and optimizer state, strategy, imbalance between devices)."""
        return self._stepper.out_of_memory(err, micro_batch)

    # -- metrics --------------------------------------------------------------------------------
    def log(self, **metrics: torch.Tensor | float) -> None:
        """Accumulate metrics on the device; every ``log_every`` calls, average them over the
        calls and the ranks, read them back once, and append them to ``rt.history``."""
        self._metrics.log(self.state.global_step, metrics)

    def log_metrics(self, **metrics: torch.Tensor | float) -> dict[str, float]:
        """Record values the program computed itself (a validation loss, an accuracy) at the
        current step, as they are: appended to ``rt.history`` on this rank, no averaging over
        ranks (combine them first, e.g. with ``rt.gather_for_metrics`` or ``rt.all_reduce``).
        A tensor is read back once here. Returns the record."""
        return self._metrics.record(self.state.global_step, metrics)

    def flush_logs(self) -> dict[str, float]:
        """Read back what ``log`` accumulated now (every rank must call it together)."""
        self._ensure_ready()
        return self._metrics.flush(self.state.global_step)

    def _close_window(self) -> None:
        """Read back what ``log`` has pending: only where every rank is (the end of a pass,
        a save, the end of the launched function), since it is collective."""
        if self._metrics.pending:
            self._metrics.flush(self.state.global_step)

    def _end_of_pass(self, trained: bool) -> None:
        # Every rank ends the pass together: a logging window never spans two epochs, and a
        # loop's last window is read back before anyone reads rt.history alone. A pass that
        # trained nothing (an evaluation) leaves the training's window and schedulers alone.
        if not trained:
            return
        self._close_window()
        for scheduler in self.state.schedulers:
            scheduler.loader_pass_ended()

    # -- processes ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait for every rank."""
        self._ensure_ready()
        self.lifecycle.beat("collective", self.state.global_step)
        self.strategy.barrier()

    def all_reduce(self, value: torch.Tensor | float, op: ReduceOp = "mean") -> Any:
        """``value`` combined over the ranks by "mean", "sum", "max" or "min": a tensor on any
        device (the result comes back on that device) or a Python number (a number back)."""
        self._ensure_ready()
        self.lifecycle.beat("collective", self.state.global_step)
        return collectives.all_reduce(self.strategy, value, op)

    def all_gather(self, value: torch.Tensor | float) -> Any:
        """Every rank's ``value`` in rank order: tensors (the same shape and dtype on every
        rank) stacked on a new first dimension, on the tensor's device; numbers as a list.
        Under several processes the ranks first exchange the shapes (one small object
        exchange): tensors that differ are a ConfigError on every rank (for rows that differ,
        as in a last evaluation batch, use ``rt.gather_for_metrics``)."""
        self._ensure_ready()
        self.lifecycle.beat("collective", self.state.global_step)
        return collectives.all_gather(self.strategy, value)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank: a tensor (same shape and dtype on every
        rank; the result on the tensor's device) or any picklable object."""
        self._ensure_ready()
        self.lifecycle.beat("collective", self.state.global_step)
        return collectives.broadcast(self.strategy, value, src)

    @contextlib.contextmanager
    def main_process_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on rank 0 first (``local=True``: on each machine's local rank 0),
        then on the others: one download or cache build, which the others then read.

        >>> import gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> with rt.main_process_first():
        ...     pass  # download the dataset here
        """
        self._ensure_ready()
        first = (self.local_rank if local else self.rank) == 0
        with collectives.first_then_others(self.strategy, first):
            yield

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_global_zero:
            builtins.print(*args, **kwargs)

    def skipped_steps(self) -> int:
        """Steps the non-finite guard skipped so far (one read back; 0 without a guard)."""
        return self._stepper.skipped_steps()

    def teardown(self) -> None:
        """Drop the wrapped models, then leave the process group this Runtime joined."""
        # DDP's reducer must go while its group exists (at exit it can block forever), a GPU's
        # memory held in cycles must come back now; on a CPU alone a collection only costs time.
        _OPEN.discard(self)
        self.lifecycle.close()
        self.state.clear()
        self._stepper.close()
        # The ignore: torch declares cuda.is_initialized without annotations.
        if in_real_process_group() or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            gc.collect()
        self.strategy.teardown()
        # Last: a logger that fails to finalize must not leave the process group behind.
        self._finish_logging("failed" if sys.exc_info()[0] else "success")  # if not before

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        if self.strategy.needs_launch:
            raise ConfigError(
                f"strategy {self.strategy.name!r} needs {self.world_size} processes: put the "
                "training in a function and start it with rt.launch(fn), or run the script "
                f"with `gpukit launch --nproc {self.world_size}`"
            )
        self.strategy.setup_environment()
        self._ready = True
        _OPEN.add(self)
        self._start_loggers()


# Runtimes set up and not yet torn down, for the launcher's runner to close (see below).
_OPEN: weakref.WeakSet[Runtime] = weakref.WeakSet()


def teardown_open_runtimes() -> int:
    """Tear down every Runtime this process set up and left open; how many there were. A
    script run by gpukit's launcher often ends without ``rt.teardown()``: the runner calls this
    when the script returns, so the ranks leave their process group in order (the models'
    reducers first) before the interpreter shuts down, where gloo's threads would abort it."""
    left = list(_OPEN)
    for rt in left:
        rt.teardown()
    return len(left)


# help(gk.Runtime) shows each setting's text.
Runtime.__doc__ = f"{Runtime.__doc__}\n{arguments_doc(indent=4)}"


def _then_close_window(fn: Callable[..., Any], rt: Runtime, *args: Any) -> Any:
    """``fn(rt, *args)``, then the last logging window read back: every rank that returns
    normally reaches this point (module level, so a new interpreter can import it). The loggers are
    finalized here, as failed when ``fn`` raised."""
    try:
        result = fn(rt, *args)
        rt._close_window()
    except BaseException:
        rt._finish_logging("failed")
        raise
    rt.lifecycle.finished(rt.global_step)
    rt._finish_logging("success")
    return result
