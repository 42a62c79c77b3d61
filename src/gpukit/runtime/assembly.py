"""How a Runtime's parts are made from its settings, before any model exists: the strategy
for the devices named and the precision it trains in (each checked against the other), the
stepper, with the non-finite guard it keeps, the run's lifecycle with the checkpoint part it
saves and resumes through (and the heartbeat's figures, when a launcher watches), and the
loggers with what they are told (and the launcher's events, on rank 0).

>>> from gpukit.runtime.settings import Settings
>>> strategy, precision = strategy_and_precision(Settings(devices="cpu"), launched=False)
>>> strategy.name, precision.name, nonfinite_guard(Settings(), precision)
('single', '32', None)
"""

from __future__ import annotations

from gpukit import _env
from gpukit.launch.faults import OomFault
from gpukit.lifecycle.boundaries import Lifecycle
from gpukit.loggers.registry import make_loggers
from gpukit.runtime.checkpointing import Checkpointing, RuntimeCalls
from gpukit.runtime.outputs.job_events import JobEvents
from gpukit.runtime.outputs.reporting import Reporting
from gpukit.runtime.parallel_setting import parallel_strategy
from gpukit.runtime.settings import Settings, record, run_folder
from gpukit.runtime.settings_checks import check_device_count, resolve_devices
from gpukit.runtime.state import TrainState
from gpukit.runtime.step.boundaries import StepBoundaries
from gpukit.runtime.step.nonfinite import NonFiniteGuard
from gpukit.runtime.step.precision import Precision, make_precision
from gpukit.runtime.step.stepper import Stepper
from gpukit.strategies import Strategy, choose, collectives
from gpukit.strategies.meta_init import MetaInit


def strategy_and_precision(settings: Settings, launched: bool) -> tuple[Strategy, Precision]:
    """The strategy ``settings`` name for their devices (``launched``: this process is one
    rank of a launched job), with a meta model's init, and the precision it trains in."""
    devices = resolve_devices(settings.devices, launched)
    strategy = choose(parallel_strategy(settings.parallel) or settings.strategy, devices, launched)
    strategy.meta_init = MetaInit(settings.init, settings.seed)  # a meta model's init
    check_device_count(settings.devices, devices, strategy)
    precision = make_precision(settings.precision, strategy.device.torch)
    strategy.check_precision(precision.name)
    return strategy, precision


def nonfinite_guard(settings: Settings, precision: Precision) -> NonFiniteGuard | None:
    """The step's guard against non-finite losses and gradients, when ``nonfinite`` asks."""
    if settings.nonfinite is None:
        return None
    return NonFiniteGuard(settings.nonfinite, settings.log_every, precision.name)


def make_stepper(
    settings: Settings,
    state: TrainState,
    strategy: Strategy,
    precision: Precision,
    boundaries: StepBoundaries,
) -> Stepper:
    """The step under ``strategy``, with the out-of-memory fault a test may inject through the
    environment and the non-finite guard the settings ask for, telling ``boundaries``."""
    fault = OomFault.from_env(strategy.device.torch)
    guard = nonfinite_guard(settings, precision)
    return Stepper(settings, state, strategy, precision, fault, boundaries=boundaries, guard=guard)


def make_reporting(settings: Settings, state: TrainState, strategy: Strategy) -> Reporting:
    """The loggers ``settings`` name (a missing package is refused here, when the Runtime is
    made), told the settings from rank 0 of ``strategy``."""
    loggers = make_loggers(settings.loggers, run_folder(settings.checkpoints))
    # Rank 0 tells its loggers what gpukit's launcher says of the job (stragglers).
    events = JobEvents.open(_env.job_dir()) if loggers and strategy.rank == 0 else None
    return Reporting(loggers, record(settings), state, strategy, events)


def make_lifecycle(
    settings: Settings,
    state: TrainState,
    strategy: Strategy,
    precision: Precision,
    runtime: RuntimeCalls,
) -> tuple[Lifecycle, Stepper, Checkpointing]:
    """The run's lifecycle, the stepper that tells it where each step begins and ends, and the
    checkpoint part (``rt.save``, ``rt.resume``, ...) that the lifecycle saves and resumes
    through, which in turn tells the lifecycle and the stepper what a save or a load did."""
    lifecycle = Lifecycle(
        settings,
        strategy.rank,
        strategy.world_size,
        settings.log_every,
        # The part is made below, once the stepper exists: these run after that.
        save=lambda background: checkpoints.save_now(background=background and settings.async_save),
        # Asked through the part's strategy, which strategy="auto" may replace at rt.setup.
        agree=lambda votes: checkpoints.strategy.any_rank(votes),
        store=collectives.default_store,
        resume=lambda: checkpoints.resume(),
        deferrable=lambda: any(loader.in_pass for loader in state.loaders),
        settle=lambda: checkpoints.settle("the end of the run"),
    )
    lifecycle.watch(strategy.device.torch, settings.accumulate)
    stepper = make_stepper(settings, state, strategy, precision, lifecycle)
    checkpoints = Checkpointing(settings, state, strategy, precision, lifecycle, stepper, runtime)
    return lifecycle, stepper, checkpoints
