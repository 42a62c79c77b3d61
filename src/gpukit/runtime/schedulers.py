"""Learning-rate schedulers that follow the data, not the number of ranks.

A scheduler handed to ``rt.setup`` is taken as written for the one-process program: built
from ``len(loader)`` of the whole data set and stepped once per optimizer step. Under N
data-parallel ranks that split the batches (ddp, fsdp) each optimizer step covers N times the
samples, so :class:`Scheduler`, what ``rt.setup`` returns in its place, steps it N times per
``step()`` call: the learning rate at a given number of samples seen is the one-process
program's. Where each rank takes a piece of every batch instead (Accelerate's order with
``split_batches=True``), an optimizer step covers one of the loader's batches: once per call.
It does not step it at all when the optimizer step was skipped (a 16-mixed overflow, or the
non-finite guard), nor while gradients accumulate (a loop that calls ``step()`` after every
micro-batch). A scheduler stepped less often than the optimizer (once an epoch: the same
data on any number of ranks) is stepped once per call. ``Runtime(scheduler_steps=
"per-optimizer-step")`` keeps one step per call for a scheduler already written for N ranks.

It wraps rather than patches: ``SequentialLR`` and ``ChainedScheduler`` step their children
through ``step()``, which must stay the scheduler's own. Everything else (``get_last_lr``,
``state_dict``, attributes) is the scheduler's.

>>> import torch
>>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
>>> steps = Scheduler(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), repeats=2)
>>> opt.step(); steps.optimizer_stepped(opt, ran=True); steps.step()
>>> steps.get_last_lr()
[0.25]
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, get_args

import torch

from gpukit._util.text import described
from gpukit.errors import ConfigError, warn_user

SchedulerSteps = Literal["per-sample", "per-optimizer-step"]
_OWN = frozenset(
    [
        "scheduler",
        "repeats",
        "ran",
        "skipped",
        "pass_ended",
        "per_step",
        "_mid_window",
        "_optimizer",
        "_bad",
        "_flagged",
        "_seen",
        "_warned",
    ]
)


def check_scheduler_steps(value: object) -> None:
    """ConfigError unless ``value`` names how schedulers step.

    >>> check_scheduler_steps("per-sample")
    """
    if not (isinstance(value, str) and value in get_args(SchedulerSteps)):
        raise ConfigError(
            f"scheduler_steps={described(value)}: use 'per-sample' (a scheduler written for one "
            "process follows the samples seen: stepped once per rank that splits the batches) "
            "or 'per-optimizer-step' (stepped once per call, for a scheduler already written "
            "for this number of ranks)"
        )


def is_scheduler(obj: object) -> bool:
    """Whether ``obj`` is one of torch's learning-rate schedulers (ReduceLROnPlateau is not an
    ``LRScheduler`` before torch 2.2)."""
    schedulers = torch.optim.lr_scheduler
    kinds = (schedulers.LRScheduler, schedulers.ReduceLROnPlateau)
    return isinstance(obj, kinds)


class Scheduler:
    """``scheduler``, stepped ``repeats`` times per call that follows one optimizer step that
    ran; see the module docstring. ``mid_window`` says whether gradients are accumulating."""

    def __init__(self, scheduler: Any, repeats: int = 1, mid_window: Any = lambda: False) -> None:
        self.scheduler = scheduler
        self.repeats = repeats
        self._mid_window = mid_window
        self._optimizer = getattr(scheduler, "optimizer", None)
        if self._optimizer is None and getattr(scheduler, "_schedulers", None):
            # ChainedScheduler before torch 2.2 names no optimizer: its children do.
            self._optimizer = getattr(scheduler._schedulers[0], "optimizer", None)
        self.ran = 0  # optimizer steps that ran since the last call
        self.skipped = 0  # and that were skipped
        # The non-finite guard's flags since the last call, summed on the device (one small
        # add per step), read once per call.
        self._bad: torch.Tensor | None = None
        self._flagged = 0
        self.pass_ended = False  # a loader's pass ended since the last optimizer step
        # Whether the program steps it once per optimizer step (learned from its calls; None
        # until a call follows an optimizer step): a checkpoint taken inside rt.step, before
        # the program's own call, owes that call.
        self.per_step: bool | None = None
        self._seen = getattr(scheduler, "last_epoch", None)  # after this wrapper's last step
        self._warned = False

    # -- what the Runtime tells it ---------------------------------------------------------------
    def optimizer_stepped(
        self, optimizer: Any, ran: bool, flag: torch.Tensor | None = None
    ) -> None:
        """``optimizer`` stepped (``ran``: False when the step was skipped); ``flag``: the
        non-finite guard's device flag, 1.0 when it skipped the step (read at the next call)."""
        if optimizer is not self._optimizer:
            return
        now = getattr(self.scheduler, "last_epoch", None)
        if self.repeats > 1 and now != self._seen and not self._warned:
            self._warned = True
            warn_user(
                f"{type(self.scheduler).__name__} was stepped directly, not through what "
                f"rt.setup returned for it: over {self.repeats} ranks that split the batches it "
                "then follows the optimizer steps, not the samples seen. Step the scheduler "
                "rt.setup returned (model, opt, sched = rt.setup(model, opt, sched))"
            )
        self.pass_ended = False  # a call now is the step's, not the epoch's
        if flag is not None:
            self._bad = flag.detach() if self._bad is None else self._bad + flag.detach()
            self._flagged += 1
        elif ran:
            self.ran += 1
        else:
            self.skipped += 1

    def loader_pass_ended(self) -> None:
        """A pass over a loader ended: a call before the next optimizer step is the epoch's."""
        self.pass_ended = True

    # -- the scheduler's interface ---------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the scheduler as the one-process program would have (module docstring)."""
        ran, skipped = self._take()
        pass_ended, self.pass_ended = self.pass_ended, False
        if ran == 0 and (skipped or self._mid_window()):
            return  # the optimizer did not step: neither does the learning rate
        times = 1
        if ran == 1 and not pass_ended:
            self.per_step = True
            if not args and not kwargs:  # a metric (ReduceLROnPlateau) is seen once
                times = self.repeats
        elif ran:
            self.per_step = False
        if times > 1:  # the ranks' steps, each stopped at a schedule's end
            self._repeat(times)
        else:  # the program's own call, as one process makes it (past the end: its error)
            self.scheduler.step(*args, **kwargs)
        self._seen = getattr(self.scheduler, "last_epoch", None)

    def owed(self) -> int:
        """Scheduler steps the program's next call owes (saved in a checkpoint taken between
        an optimizer step and that call): a resumed run makes them before its first step."""
        self._read_flags()
        if self.ran == 0:
            return 0  # the program has made its call since the last optimizer step
        if self.pass_ended:
            return 1  # saved at the end of a pass, before the epoch's call
        return self.repeats if self.ran == 1 and self.per_step is not False else 0

    def settle(self, owed: int, per_step: bool | None) -> None:
        """After a load: make the ``owed`` steps, and forget what happened before it."""
        self.ran = self.skipped = self._flagged = 0
        self._bad = None
        self.pass_ended = False
        self.per_step = per_step
        if owed:
            with warnings.catch_warnings():
                # This process's optimizer has not stepped yet, which torch's check takes for
                # a scheduler stepped too early: here it makes up the call the save preceded.
                warnings.filterwarnings(
                    "ignore", "Detected call of `lr_scheduler.step", UserWarning
                )
                self.scheduler.step()
                self._repeat(owed - 1)
        self._seen = getattr(self.scheduler, "last_epoch", None)

    def _repeat(self, times: int) -> None:
        for _ in range(times):
            # One-process schedules end at total_steps (OneCycleLR refuses a step past it);
            # N ranks padding their last batch may ask for a few steps beyond.
            total = getattr(self.scheduler, "total_steps", None)
            if isinstance(total, int) and self.scheduler.last_epoch >= total:
                return
            self.scheduler.step()

    def _read_flags(self) -> None:
        if self._bad is not None:  # one read for the guard's flags since the last call
            bad = int(self._bad.item())
            self.ran += self._flagged - bad
            self.skipped += bad
            self._bad, self._flagged = None, 0

    def _take(self) -> tuple[int, int]:
        self._read_flags()
        taken = self.ran, self.skipped
        self.ran = self.skipped = 0
        return taken

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's own state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scheduler's own state."""
        self.scheduler.load_state_dict(state)
        self._seen = getattr(self.scheduler, "last_epoch", None)

    def __setattr__(self, name: str, value: Any) -> None:
        # The wrapper's own bookkeeping stays here; anything else is the scheduler's.
        if name in _OWN or "scheduler" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.scheduler, name, value)

    def __getattr__(self, name: str) -> Any:
        scheduler = self.__dict__.get("scheduler")
        if scheduler is None:
            raise AttributeError(name)
        return getattr(scheduler, name)

    def __repr__(self) -> str:
        return f"Scheduler({self.scheduler!r}, repeats={self.repeats})"
