"""Strategies: how training is spread over devices and processes.

``registry`` (names, :func:`register` and the ``"auto"`` choice), ``base`` (the contract: a
few hooks, three of them required, and ``Recovery``, what runs when a device runs out of memory),
``traits`` (what each costs in memory and communication, which the planner reads),
``collectives`` (over any strategy, on what a training loop holds: tensors on any device and
plain numbers), one module per strategy (``single``, ``dp`` with ``dp-balanced``, ``ddp``,
``fsdp``, with ``tensor_plans``: tensor-parallel plans read from the model), ``float8``
(torchao's float8 Linear layers, a strategy's ``float8=`` setting), ``per_device`` (what a
``dp-balanced`` forward returns), and the private pieces of single-process data parallelism
(``_parallel``: scatter, replicate, apply, gather;
``_criterion``: the loss on every device).

>>> from gpukit.strategies import make_strategy
>>> make_strategy("single").name
'single'
"""

from __future__ import annotations

from gpukit.strategies.base import MemoryAdvice, Recovery, ReduceOp, Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.dp import DP, DPBalanced
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.layout import Layout
from gpukit.strategies.mesh import Parallel
from gpukit.strategies.per_device import PerDevice
from gpukit.strategies.registry import (
    STRATEGIES,
    choose,
    make_strategy,
    register,
    traits_of,
    unregister,
)
from gpukit.strategies.single import SingleDevice
from gpukit.strategies.traits import Collective, Traits

__all__ = [
    "DDP",
    "DP",
    "FSDP",
    "STRATEGIES",
    "Collective",
    "DPBalanced",
    "Layout",
    "MemoryAdvice",
    "Parallel",
    "PerDevice",
    "Recovery",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "Traits",
    "choose",
    "make_strategy",
    "register",
    "traits_of",
    "unregister",
]
