"""``strategy="auto"`` and a model too large for ddp: fsdp instead, decided at ``rt.setup``.

``"auto"`` picks ddp for several devices when the Runtime is made, before any model exists
(the processes, their process group and the data's sharding are the same under fsdp). The
first ``rt.setup(model, ...)`` then asks the planner's closed form once whether ddp's
replicated training (weights, gradients, AdamW's state and activations at the run's
micro-batch) fits each device's memory. Only when it does not, and fsdp does, the Runtime takes
fsdp instead, before anything of the model is placed, and says so once on rank 0; a model that
fits keeps ddp exactly as before (nothing of this runs on the per-step path). When neither
fits, ddp stays and the planner's figures are said, with ``gpukit plan`` to find what fits.

The planner sits above the Runtime's layer: it installs its estimate here
(:func:`use_estimator`) when ``gpukit`` is imported.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from gpukit.runtime.settings import Settings
from gpukit.runtime.step.stepper import Stepper
from gpukit.strategies import Strategy
from gpukit.strategies.auto import fsdp_in_place_of, replaceable


@dataclass(frozen=True)
class Question:
    """What ``strategy="auto"`` asks the planner at the first ``rt.setup``: ``model`` (the
    user's), trained on ``devices`` ranks each with ``capacity`` bytes (the smallest device
    this process knows; ``kind`` "cuda" or "cpu"), at ``micro_batch`` samples per micro-step
    (0: unknown), with ``accumulate`` micro-steps and ``precision``; ``example``: returns one
    (input, target) item of the training data (or None), called only where the activations
    can decide, with every random generator left as it was."""

    model: nn.Module
    devices: int
    capacity: int
    kind: str
    micro_batch: int
    accumulate: int
    precision: str
    example: Callable[[], Any] = lambda: None


@dataclass(frozen=True)
class Answer:
    """The planner's answer: ``shard`` (True: fsdp, not ddp) and the words to say on rank 0
    (None: nothing to say, ddp fits)."""

    shard: bool
    said: str | None = None


Estimator = Callable[[Question], Answer]
_ESTIMATOR: list[Estimator] = []


def use_estimator(estimator: Estimator) -> None:
    """Install the function that answers ``strategy="auto"``'s question (the planner's)."""
    _ESTIMATOR[:] = [estimator]


class AutoChoice:
    """The Runtime's part in ``strategy="auto"`` (see the module doc): whether it has asked
    the planner yet, under its ``settings``. It holds no strategy: it is given the one the
    Runtime holds, and says which to take instead."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.asked = False

    def pending(self, strategy: Strategy) -> bool:
        return (
            self.settings.strategy == "auto"
            # oom="recover" over several ranks is ddp's alone (fsdp refuses it): ddp stays.
            and self.settings.oom != "recover"
            and not self.asked
            and replaceable(strategy)
            and bool(_ESTIMATOR)
        )

    def decide(
        self,
        strategy: Strategy,
        precision: str,
        ready: bool,
        model: nn.Module,
        objects: tuple[Any, ...],
    ) -> Strategy | None:
        """At the first ``rt.setup``: fsdp in place of ``strategy`` (ddp) when ddp does not
        fit (module doc), else None. ``ready``: the process group is up, so the ranks agree."""
        if not self.pending(strategy):
            return None
        self.asked = True
        capacities = [d.total_memory for d in strategy.devices]
        if not capacities or not all(capacities) or not isinstance(model, nn.Module):
            return None  # a device of unknown size: nothing to decide by
        example, micro = _data(objects, self.settings.accumulate)
        question = Question(
            model=model,
            devices=strategy.world_size,
            capacity=min(int(c) for c in capacities if c),
            kind=strategy.device.type,
            micro_batch=micro,
            accumulate=self.settings.accumulate,
            precision=precision,
            example=example,
        )
        try:
            answer = _ESTIMATOR[0](question)
        except Exception:  # an estimate that fails must not stop a run that ddp may fit
            answer = Answer(shard=False)
        switch = answer.shard
        # Every rank decides alike: another node's devices may be smaller than this one's.
        if strategy.world_size > 1 and ready:
            switch = strategy.any_rank([switch])[0]
        said = answer.said
        if switch and not answer.shard:
            said = "auto: another rank's devices cannot hold ddp's training: using fsdp"
        if strategy.rank == 0 and said:
            print(said, flush=True)
        return fsdp_in_place_of(strategy, ready=ready) if switch else None


def stepper_for(strategy: Strategy, old: Stepper) -> Stepper:
    """A stepper like ``old`` (no step taken yet) that steps under ``strategy``."""
    return Stepper(
        old.config,
        old.state,
        strategy,
        old.precision,
        old.fault,
        boundaries=old.boundaries,
        guard=old.guard,
    )


def _data(objects: tuple[Any, ...], accumulate: int) -> tuple[Callable[[], Any], int]:
    """A reader of one item of the first map-style DataLoader in ``objects`` (its dataset's
    first, read with the random generators kept as they were, so that the run draws the same
    numbers) and that loader's micro-batch; (a reader of None, 0) when there is none."""
    for obj in objects:
        if isinstance(obj, DataLoader) and not isinstance(obj.dataset, IterableDataset):
            batch = obj.batch_size or 0
            return functools.partial(_first_item, obj.dataset), max(1, batch // accumulate)
    return lambda: None, 0


def _first_item(dataset: Any) -> Any:
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            return dataset[0]
    except Exception:
        return None
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
