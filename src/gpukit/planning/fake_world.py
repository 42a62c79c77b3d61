"""The world the planner's simulation runs in: a fake process group, torch's fake tensor mode,
and the process's random state kept as it was, so that a program that plans and then trains
trains as it would have."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


def fake_store() -> Any:
    """torch's store that answers every request, for a fake process group; None without one."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return FakeStore


@contextlib.contextmanager
def fake_world(ranks: int | None) -> Iterator[None]:
    """A fake process group of ``ranks`` ranks, this process rank 0 (None: no group, for a
    strategy without a process per device)."""
    if ranks is None:
        yield
        return
    dist.init_process_group("fake", store=fake_store()(), rank=0, world_size=ranks)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_mode() -> Iterator[Any]:
    """torch's fake tensor mode, taking real tensors in where they meet fake ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real inputs (the dataset's items) turn into fake ones where they meet fake tensors.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Building a workload seeds torch's generators and the loader draws from them; the
    program that planned must not notice: Python's, numpy's and torch's CPU state are
    restored, and so are the GPUs' where CUDA has started. Where it has not, seeding the GPUs
    is left out: torch would queue it for when CUDA starts, after the program's own seed."""
    py, np_state = random.getstate(), np.random.get_state()
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    gpus = list(range(torch.cuda.device_count())) if cuda_started else []
    seed_gpus = torch.cuda.manual_seed_all
    try:
        if not cuda_started:
            torch.cuda.manual_seed_all = _no_gpu_seed
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        torch.cuda.manual_seed_all = seed_gpus
        random.setstate(py)
        np.random.set_state(np_state)


def _no_gpu_seed(seed: int) -> None:
    """Seeding GPUs that have not started, left out while simulating (see above)."""
