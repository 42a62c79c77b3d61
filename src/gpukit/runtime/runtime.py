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

import functools
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import DataLoader

from gpukit._util import placement
from gpukit._util.fake import in_real_process_group
from gpukit.checkpoint.live import user_model
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.launch import DEFAULT_HANG_TIMEOUT
from gpukit.launch.functions import check_options, launch_function
from gpukit.lifecycle.checks import ResumePolicy
from gpukit.loggers.registry import LoggersSpec
from gpukit.runtime import owned
from gpukit.runtime.assembly import make_lifecycle, make_reporting, strategy_and_precision
from gpukit.runtime.checkpointing import Checkpointing, RuntimeCalls
from gpukit.runtime.compiling import Compiler
from gpukit.runtime.data.dealing import data_order
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.data.wait import DataWait
from gpukit.runtime.launched_function import then_close_window
from gpukit.runtime.logging_calls import Logging
from gpukit.runtime.open_runtimes import OPEN
from gpukit.runtime.open_runtimes import teardown_open_runtimes as teardown_open_runtimes
from gpukit.runtime.outputs.evaluation import Evaluation
from gpukit.runtime.outputs.metrics import Metrics
from gpukit.runtime.outputs.profiling import Profiling
from gpukit.runtime.outputs.progress import Progress
from gpukit.runtime.outputs.reporting import Reporting
from gpukit.runtime.owned import Registry
from gpukit.runtime.processes import Processes
from gpukit.runtime.properties import Counter, Delegate, View, described
from gpukit.runtime.schedulers import SchedulerSteps
from gpukit.runtime.settings import DataOrderName, ExportPolicy, Settings, arguments_doc
from gpukit.runtime.settings_checks import DevicesSpec, OomPolicy
from gpukit.runtime.setup_calls import returned, split_setup
from gpukit.runtime.state import TrainState
from gpukit.runtime.step.loss_targets import with_target_check
from gpukit.runtime.step.nonfinite import NonFinitePolicy
from gpukit.runtime.step.optimizer_adoption import adopt, parameters, refuse_foreign
from gpukit.runtime.step.snapshot import seed_everything
from gpukit.runtime.strategy_at_setup import AutoChoice, stepper_for
from gpukit.strategies import Strategy


class Runtime:
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
        async_save: bool = False,
        data_wait: bool = False,
        data_order: DataOrderName = "torch",
        even_batches: bool | None = None,
        split_batches: bool | None = None,
        parallel: dict[str, Any] | str | None = None,
    ) -> None:
        # Every keyword above by name (tests/runtime/test_runtime_keywords.py: as in Settings).
        arguments = {name: value for name, value in locals().items() if name != "self"}
        self.config = settings = Settings(**arguments)
        launched = placement.launched() is not None
        self.strategy, self.precision = strategy_and_precision(settings, launched)
        self._compiler = Compiler(settings.compile, self.strategy)
        self.state = TrainState()
        # The parts behind the methods below that hand them their work (``Delegate``).
        self._processes = Processes(self.strategy, self._before_collective, self._ensure_ready)
        calls = RuntimeCalls(self._ensure_ready, lambda: self._logging.close_window(), self.print)
        self.lifecycle, self._stepper, self._checkpointing = make_lifecycle(
            settings, self.state, self.strategy, self.precision, calls
        )
        # data_wait in rt.history, where asked for (gpukit.runtime.data.wait)
        self._data_wait = DataWait() if settings.data_wait else None
        device, wait = self.strategy.device.torch, self._data_wait
        self._metrics = Metrics(device, settings.log_every, self.strategy, wait)
        self._registry = Registry(settings, self.state)
        self._evaluation = Evaluation(self.strategy, self._before_collective)
        self._logging = Logging(self._metrics, self.state, self._ensure_ready)
        self._progress = Progress(self.strategy, self._metrics.history)
        self._profiling = Profiling(self._stepper, self.strategy)
        self._reporting = make_reporting(settings, self.state, self.strategy)
        self.loggers = self._reporting.loggers
        if self.loggers:
            self._metrics.on_record = self._reporting.record
        self._auto = AutoChoice(settings)  # strategy="auto": fsdp where ddp cannot fit
        self._ready = False
        if settings.seed is not None:
            seed_everything(settings.seed)
        if launched and not self.strategy.needs_launch:
            # One rank of a launched job joins its process group now, as Accelerate's
            # constructor does: what the program builds before rt.setup (a
            # DistributedSampler, a barrier around a download) needs it.
            self._ensure_ready()

    # -- views: read from the settings, the progress and the strategy when read --------------
    accumulate = View(lambda rt: rt.config.accumulate)
    clip = View(lambda rt: rt.config.clip)
    seed = View(lambda rt: rt.config.seed)
    log_every = View(lambda rt: rt.config.log_every)
    oom = View(lambda rt: rt.config.oom)
    nonfinite = View(lambda rt: rt.config.nonfinite)
    settings = View(
        lambda rt: rt.config,
        "Every setting this Runtime was made with (``gpukit.runtime.settings``).",
    )
    global_step = Counter("Optimizer steps taken.")
    micro_step = Counter("Backward passes taken.")
    oom_split = Counter("Micro-batches per accumulation step, raised by out-of-memory recovery.")
    oom_events = View(
        lambda rt: rt.state.oom_events,
        "One record per out-of-memory recovery: step, micro-batch before and after.",
    )
    loaders = View(lambda rt: rt.state.loaders)
    device = View(
        lambda rt: rt.strategy.device.torch,
        """The device this process trains on, as a ``torch.device``: ``x.to(rt.device)`` and
        ``torch.zeros(2, device=rt.device)`` work as they do with plain PyTorch.""",
    )
    device_info = View(
        lambda rt: rt.strategy.device,
        """gpukit's :class:`Device` for ``rt.device``: its name, memory and compute
        capability.""",
    )
    rank = View(lambda rt: rt.strategy.rank)
    local_rank = View(lambda rt: rt.strategy.local_rank)
    world_size = View(lambda rt: rt.strategy.world_size)
    is_global_zero = View(lambda rt: rt.strategy.rank == 0)
    __repr__ = described

    # -- what the Runtime's parts do: each method is the part's own (signature, docstring) ---
    track = Delegate("_registry", Registry.track)
    gather_for_metrics = Delegate("_evaluation", Evaluation.gather_for_metrics)
    pad_across_processes = Delegate("_evaluation", Evaluation.pad_across_processes)
    evaluating = Delegate("_evaluation", Evaluation.evaluating)
    progress = Delegate("_progress", Progress.progress)
    profile = Delegate("_profiling", Profiling.profile)
    log_hyperparams = Delegate("_reporting", Reporting.log_hyperparams)
    barrier = Delegate("_processes", Processes.barrier)
    all_reduce = Delegate("_processes", Processes.all_reduce)
    all_gather = Delegate("_processes", Processes.all_gather)
    broadcast = Delegate("_processes", Processes.broadcast)
    main_process_first = Delegate("_processes", Processes.main_process_first)
    print = Delegate("_processes", Processes.print)
    save = Delegate("_checkpointing", Checkpointing.save)
    load = Delegate("_checkpointing", Checkpointing.load)
    load_weights = Delegate("_checkpointing", Checkpointing.load_weights)
    full_state_dict = Delegate("_checkpointing", Checkpointing.full_state_dict)
    resume = Delegate("_checkpointing", Checkpointing.resume)
    wait_for_save = Delegate("_checkpointing", Checkpointing.wait_for_save)
    log = Delegate("_logging", Logging.log)
    log_metrics = Delegate("_logging", Logging.log_metrics)
    flush_logs = Delegate("_logging", Logging.flush_logs)

    @property
    def history(self) -> list[dict[str, float]]:
        """What ``rt.log`` read back, one record per window. A window closes every
        ``log_every`` calls, when a loader's pass runs to its end, at ``rt.save``, and when the
        function ``rt.launch`` runs returns (points every rank reaches together, so the last
        partial window is there at the end and any rank may read this alone); reading it never
        reads anything back itself, so a progress display may read it every step.
        ``rt.flush_logs()`` closes the window now. A window with batches from ``rt.setup``'s
        loaders also holds how long they were waited for (``gpukit.runtime.data.wait``)."""
        return self._metrics.history

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
        to ``max_restarts`` times after a failure at any moment once the job has taken a step
        (``resume="auto"`` resumes them from the newest checkpoint). Otherwise calls ``fn``
        here. When ``fn`` returns, the last logging window is read back (every rank is there).
        """
        check_options(max_restarts, hang_timeout)
        run = functools.partial(then_close_window, fn)
        if not self.strategy.needs_launch:
            return run(self, *args)
        # Each process builds its own Runtime from the same settings (its rank: from its env).
        settings = self.config.keywords()
        make = functools.partial(Runtime, **settings)
        return launch_function(
            make, self.world_size, run, args, max_restarts=max_restarts, hang_timeout=hang_timeout
        )

    def setup(self, *objects: Any) -> Any:
        """Place the model for the strategy and precision and register optimizers, schedulers,
        DataLoaders and objects with a ``state_dict`` (alone or in lists, tuples, dicts) for
        checkpoints, or refuse them (``gpukit.runtime.owned``); or set up DataLoaders alone,
        before or after the model (``gpukit.runtime.setup_calls``). Returns what it was given in
        the same order and shape (the model, DataLoaders and schedulers wrapped; one object
        alone, not in a tuple). The user's module is never changed beyond being moved. Setting
        up the same model again returns what the first call returned."""
        model, objects, first = split_setup(objects)
        self._ensure_ready()
        self.lifecycle.beat("setup", self.state.global_step)
        module = None if model is None else self._setup_model(model, objects)
        shards = self.strategy.sampler_placement()[0]
        wrap = functools.partial(self._registry.scheduler, shards=shards)
        return returned(module, owned.take_all(objects, self.state, self.setup_loader, wrap, first))

    def _setup_model(self, model: nn.Module, objects: tuple[Any, ...]) -> nn.Module:
        user = self.unwrap(model)
        module = next((m for m in self.state.modules if self.unwrap(m) is user), None)
        optimizers = owned.optimizers_in(objects)
        models = [parameters(self.unwrap(m)) for m in self.state.modules] + [parameters(user)]
        refuse_foreign(optimizers, models, self._stepper.stale)
        if module is None:
            data = (*objects, *(lo.original for lo in self.state.loaders))  # earlier loaders too
            taken = self._auto.decide(self.strategy, self.precision.name, self._ready, user, data)
            if taken is not None:
                self._use_strategy(taken)
            before = parameters(user)
            # Autocast inside the strategy's wrapper: DDP calls it as it would call the model,
            # and DDP's own switches (no_sync, buffer broadcast) stay on the outermost module.
            # compile=...: the strategy's result compiled in place (gpukit.runtime.compiling).
            placed = self._compiler.before_strategy(self.precision.setup_module(user), user)
            module = self._compiler.after_strategy(self.strategy.setup_module(placed))
            self.state.modules.append(module)
            self.lifecycle.resume_before_forward(module)
            # fsdp replaces the parameters: optimizers built before now must follow them.
            self._stepper.stale.note(adopt(before, parameters(self.unwrap(module)), optimizers))
        known = self.state.optimizers
        known += [o for o in optimizers if not any(o is k for k in known)]
        self._stepper.sync_next_backward()
        return module

    def setup_loader(self, loader: DataLoader[Any]) -> DeviceLoader:
        """Shard, re-seed every epoch, and move batches to the device (see
        ``gpukit.runtime.data.loader``)."""
        self._ensure_ready()
        self._compiler.check_loader(loader)
        shards, shard = self.strategy.sampler_placement()
        on_batch, on_handed = self.lifecycle.loader_hooks(self._evaluation.batch_handed)
        wrapped = DeviceLoader(
            loader,
            self.device,
            shards,
            shard,
            order=data_order(self.config, self._processes.broadcast),
            steps=lambda: self.state.micro_step,
            on_pass_end=self._end_of_pass,
            on_pass_start=self.lifecycle.before_first_pass,
            on_batch=on_batch,
            on_handed=on_handed,
            wait=self._data_wait,
            local=self.strategy.local_batch,
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
        if not self._ready:
            self._ensure_ready()
        if not self.lifecycle.resumed:
            self.lifecycle.before_first_pass()
        if not self._compiler.graphs:  # every step: no closure to make where nothing wraps it
            return self._stepper.train_step(optimizer, batch, compute_loss)
        return self._compiler.step(lambda: self._stepper.train_step(optimizer, batch, compute_loss))

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
        stepped = self._stepper.step(optimizer)
        self._compiler.next_step()  # under CUDA graphs, the next forward is a new replay
        return stepped

    def out_of_memory(
        self, err: BaseException | str, micro_batch: int | None = None
    ) -> OutOfMemory:
        """The error to raise for an out-of-memory ``err``: its numbers, explained with what
        this run knows (weights and optimizer state, strategy, imbalance between devices)."""
        return self._stepper.out_of_memory(err, micro_batch)

    def skipped_steps(self) -> int:
        """Steps the non-finite guard skipped so far (one read back; 0 without a guard)."""
        return self._stepper.skipped_steps()

    def _end_of_pass(self, trained: bool) -> None:
        # Every rank ends the pass together: a logging window never spans two epochs, and a
        # loop's last window is read back before anyone reads rt.history alone. A pass that
        # trained nothing (an evaluation) leaves the training's window and schedulers alone.
        if not trained:
            return
        self._logging.close_window()
        for scheduler in self.state.schedulers:
            scheduler.loader_pass_ended()

    # -- the end --------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Drop the wrapped models, then leave the process group this Runtime joined."""
        # DDP's reducer must go while its group exists (at exit it can block forever), a GPU's
        # memory held in cycles must come back now; on a CPU alone a collection only costs time.
        OPEN.discard(self)
        try:  # a checkpoint still being written finishes first (async_save)
            self._checkpointing.end(failing=sys.exc_info()[0] is not None)
        finally:
            self.lifecycle.close()
            self.state.clear()
            self._stepper.close()
            # The ignore: torch declares cuda.is_initialized without annotations.
            if in_real_process_group() or torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
                gc.collect()
            self.strategy.teardown()
            # Last: a logger that fails to finalize must not leave the process group behind.
            self._reporting.finish("failed" if sys.exc_info()[0] else "success")  # if not before

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
        OPEN.add(self)
        self._reporting.start()

    def _before_collective(self) -> None:
        self._ensure_ready()
        self.lifecycle.beat("collective", self.state.global_step)

    def _use_strategy(self, strategy: Strategy) -> None:
        """Train with ``strategy`` from now on (before any model is placed or step taken):
        each part that holds the strategy is made again for it, or given it."""
        strategy.check_precision(self.precision.name)
        self.strategy = strategy
        self._compiler = Compiler(self.config.compile, strategy)
        self._stepper = stepper_for(strategy, self._stepper)
        self._profiling.stepper = self._checkpointing.stepper = self._stepper
        self._metrics.strategy = self._evaluation.strategy = self._processes.strategy = strategy
        self._progress.strategy = self._profiling.strategy = self._reporting.strategy = strategy
        self._checkpointing.strategy = strategy


# help(gk.Runtime) shows each setting's text.
Runtime.__doc__ = f"{Runtime.__doc__}\n{arguments_doc(indent=4)}"
