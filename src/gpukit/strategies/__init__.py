"""Strategies: how training is spread over devices and processes.

``registry`` (names and the ``"auto"`` choice), ``base`` (the contract: a few hooks), one module
per strategy (``single``, ``dp`` with ``dp-balanced``, ``ddp``, ``fsdp``), ``per_device`` (what a
``dp-balanced`` forward returns), and the private pieces of single-process data parallelism
(``_parallel``: scatter, replicate, apply, gather; ``_criterion``: the loss on every device).

>>> from gpukit.strategies import make_strategy
>>> make_strategy("single").name
'single'
"""

from __future__ import annotations

from gpukit.strategies.base import MemoryAdvice, ReduceOp, Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.dp import DP, DPBalanced
from gpukit.strategies.fsdp import FSDP
from gpukit.strategies.per_device import PerDevice
from gpukit.strategies.registry import STRATEGIES, choose, make_strategy
from gpukit.strategies.single import SingleDevice

__all__ = [
    "DDP",
    "DP",
    "FSDP",
    "STRATEGIES",
    "DPBalanced",
    "MemoryAdvice",
    "PerDevice",
    "ReduceOp",
    "SingleDevice",
    "Strategy",
    "choose",
    "make_strategy",
]
