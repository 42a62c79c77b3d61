"""The Runtime's methods across its processes: ``rt.barrier``, ``rt.all_reduce``,
``rt.all_gather``, ``rt.broadcast``, ``rt.main_process_first`` and ``rt.print``.

Each collective first has the Runtime join its process group and say where it is (the
heartbeat's phase), then goes through :mod:`gpukit.strategies.collectives` over the strategy the
Runtime holds (it gives this part the new one when ``strategy="auto"`` replaces it).

>>> import gpukit as gk
>>> rt = gk.Runtime(devices="cpu")
>>> rt.all_reduce(3, "sum"), rt.broadcast({"seed": 1})
(3, {'seed': 1})
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from gpukit.strategies import ReduceOp, Strategy, collectives


class Processes:
    """Collectives over ``strategy``, each after ``before_collective`` (the Runtime joins its
    process group and beats), and ``ready`` where only the process group is needed."""

    def __init__(
        self,
        strategy: Strategy,
        before_collective: Callable[[], None],
        ready: Callable[[], None],
    ) -> None:
        self.strategy, self.before_collective, self.ready = strategy, before_collective, ready

    def barrier(self) -> None:
        """Wait for every rank."""
        self.before_collective()
        self.strategy.barrier()

    def all_reduce(self, value: torch.Tensor | float, op: ReduceOp = "mean") -> Any:
        """``value`` combined over the ranks by "mean", "sum", "max" or "min": a tensor on any
        device (the result comes back on that device) or a Python number (a number back)."""
        self.before_collective()
        return collectives.all_reduce(self.strategy, value, op)

    def all_gather(self, value: Any) -> Any:
        """Every rank's ``value`` in rank order, stacked on a new first dimension, on every
        rank and in one process too: a tensor (the same shape and dtype on every rank) as
        ``[world_size, *value.shape]`` on its device; a Python number as a 1-D tensor of
        ``world_size`` numbers on ``rt.device`` (int64, or float64 for a float), so that
        ``rt.all_gather(n).sum()`` works; dicts, lists, tuples, namedtuples and dataclasses of
        them in the same structure, each leaf gathered so. Under several processes the ranks
        first exchange the shapes (one small object exchange): tensors that differ are a
        ConfigError on every rank (for rows that differ, as in a last evaluation batch, use
        ``rt.gather_for_metrics``).

        >>> import gpukit as gk
        >>> gk.Runtime(devices="cpu").all_gather({"correct": 3})
        {'correct': tensor([3])}
        """
        self.before_collective()
        return collectives.all_gather(self.strategy, value)

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank: a tensor (same shape and dtype on every
        rank; the result on the tensor's device) or any picklable object."""
        self.before_collective()
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
        self.ready()
        first = (self.strategy.local_rank if local else self.strategy.rank) == 0
        with collectives.first_then_others(self.strategy, first):
            yield

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.strategy.rank == 0:
            builtins.print(*args, **kwargs)
