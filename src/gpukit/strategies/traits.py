"""What a strategy costs in memory and communication, as data the planner reads.

Each strategy class carries one :class:`Traits`; the planner (closed form, simulation, step
time, remedies) reads these fields through the registry and never asks which strategy it
plans. A new strategy describes itself here and is planned like the built-in ones.

>>> t = Traits(sharded=frozenset({"weights", "gradients", "optimizer_state"}))
>>> t.divisor("gradients", devices=4), Traits().divisor("gradients", devices=4)
(4, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What a training step keeps per device that a strategy may split over the devices.
State = Literal["weights", "gradients", "optimizer_state"]
STATES: tuple[State, ...] = ("weights", "gradients", "optimizer_state")
Op = Literal["all-reduce", "all-gather", "reduce-scatter", "broadcast", "reduce", "scatter-gather"]


@dataclass(frozen=True)
class Collective:
    """One collective a strategy runs, as the step time models it.

    ``op``: "all-reduce" (a ring moves 2(N-1)/N of the bytes), "all-gather" and
    "reduce-scatter" ((N-1)/N), "broadcast" and "reduce" (one device to the N-1 others,
    pipelined), "scatter-gather" (the first device sends every other its inputs and receives
    its outputs, one copy after another). ``payload``: what moves ("gradients", "weights": as
    many bytes as the parameters that train; "samples": each micro-batch's inputs and
    outputs). ``per``: once per optimizer "step" or per "micro-step". ``unit``: "whole" (one
    call), "bucket" (DDP's 25 MiB buckets: the last cannot hide), "block" (one call per block:
    the first cannot hide). ``hidden_by``: the pass whose compute it overlaps, or None.
    """

    op: Op
    payload: Literal["gradients", "weights", "samples"]
    per: Literal["step", "micro-step"] = "step"
    unit: Literal["whole", "bucket", "block"] = "whole"
    hidden_by: Literal["forward", "backward"] | None = None


@dataclass(frozen=True)
class Traits:
    """How a strategy spreads a step's memory and what it communicates.

    - ``sharded``: states split 1/N over the devices (``ceil(rows / N)`` rows per tensor);
      the others are replicated on every device.
    - ``gathers_weights``: all-gathers a block's full weights while it computes (the root's
      for the whole step, two blocks at once with prefetching) and holds one block's full
      gradients and its reduce-scatter buffer in the backward.
    - ``gradient_buckets``: keeps a flat copy of the trainable gradients for the whole run
      (DDP's reducer buckets).
    - ``drives_all_devices``: one process drives every device: the first holds the master
      weights, gradients and optimizer state and the whole batch; the others a replica.
    - ``gathers_outputs``: the first device gathers every output and computes the loss alone
      (with ``drives_all_devices``).
    - ``process_per_device``: one process per device, joined in a process group.
    - ``min_devices`` / ``max_devices``: the device counts it is planned on (None: any).
    - ``activation_checkpointing``: it has its own ``activation_checkpointing`` setting.
    - ``collectives``: what it communicates per step (see :class:`Collective`).
    """

    sharded: frozenset[State] = frozenset()
    gathers_weights: bool = False
    gradient_buckets: bool = False
    drives_all_devices: bool = False
    gathers_outputs: bool = False
    process_per_device: bool = False
    min_devices: int = 1
    max_devices: int | None = None
    activation_checkpointing: bool = False
    collectives: tuple[Collective, ...] = ()

    def divisor(self, state: State, devices: int) -> int:
        """Into how many parts ``state`` is split over ``devices`` devices."""
        return devices if state in self.sharded else 1

    def runs_on(self, devices: int) -> bool:
        """Whether this strategy is planned on ``devices`` devices."""
        return devices >= self.min_devices and (
            self.max_devices is None or devices <= self.max_devices
        )


__all__ = ["STATES", "Collective", "Op", "State", "Traits"]
