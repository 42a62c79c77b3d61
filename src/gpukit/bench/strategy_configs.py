"""The configurations of the ``strategies`` experiment: which strategy runs on how many
devices, with what batch and how many steps, and why a configuration cannot run here.

Apart from the measuring, so that what a run would cover can be listed (and tested) without
training anything: each strategy is asked what it takes (one device, or several driven from
one process), never named.

>>> [(p.strategy, p.count) for p in plan(["gpt"], ["cuda:0", "cuda:1"], (1, 2))][:3]
[('single', 1), ('dp', 1), ('dp', 2)]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from gpukit.devices import device as resolve_device
from gpukit.errors import ConfigError
from gpukit.strategies import STRATEGIES, make_strategy
from gpukit.workloads import load_workload

WORKLOADS = ("cnn", "gpt")
QUICK_WORKLOADS = ("gpt",)  # the workload whose gathered outputs (logits) weigh the most
CPU_ONLY_REASON = "needs 2+ CUDA GPUs"


@dataclass(frozen=True)
class StrategySweep:
    """What each configuration runs: per-device batch (None: the workload's), untimed and
    timed steps, and rounds (the median is reported)."""

    workloads: tuple[str, ...]
    counts: tuple[int, ...]
    batch: int | None
    warmup: int
    steps: int
    rounds: int


def settings(quick: bool, gpus: int) -> StrategySweep:
    """What ``run`` measures with ``gpus`` GPUs: 1..N devices (1 and 2 in quick mode, and on
    CPUs, where "devices" are processes sharing the same cores).

    >>> settings(quick=False, gpus=4).counts, settings(quick=True, gpus=4).counts
    ((1, 2, 3, 4), (1, 2))
    """
    if quick:
        return StrategySweep(QUICK_WORKLOADS, (1, 2), batch=16, warmup=1, steps=6, rounds=1)
    counts = tuple(range(1, max(gpus, 2) + 1))
    return StrategySweep(WORKLOADS, counts, batch=None, warmup=5, steps=40, rounds=2)


@dataclass(frozen=True)
class Planned:
    """One configuration: its devices, or the reason it cannot run here (devices None)."""

    workload: str
    strategy: str
    count: int
    devices: tuple[str, ...] | None
    reason: str | None = None


def plan(workloads: Sequence[str], gpus: Sequence[str], counts: Sequence[int]) -> list[Planned]:
    """Every configuration to report, on the first k of ``gpus`` for each k of ``counts``
    (no GPUs: k CPU processes).

    A strategy that takes one device appears at 1 device only. Without GPUs, a strategy that
    drives several devices from one process gets one row saying it needs GPUs: its replicas
    would share the same cores and memory (a test path, not a measurement).

    >>> for p in plan(["gpt"], [], (1, 2)):
    ...     print(p.strategy, p.count, p.devices, p.reason)
    single 1 ('cpu',) None
    dp 2 None needs 2+ CUDA GPUs
    dp-balanced 2 None needs 2+ CUDA GPUs
    ddp 1 ('cpu',) None
    ddp 2 ('cpu', 'cpu') None
    fsdp 1 ('cpu',) None
    fsdp 2 ('cpu', 'cpu') None
    >>> [(p.strategy, p.count, p.reason) for p in plan(["cnn"], ["cuda:0"], (1, 2))][1:3]
    [('dp', 1, None), ('dp', 2, 'needs 2 CUDA GPUs; 1 given')]
    """
    found = []
    for workload in workloads:
        for name in STRATEGIES:
            one_device, drives_several = kind(name)
            for k in counts:
                if one_device and k > 1:
                    continue
                if len(gpus) >= k:
                    found.append(Planned(workload, name, k, tuple(gpus[:k])))
                elif gpus:
                    why = f"needs {k} CUDA GPUs; {len(gpus)} given"
                    found.append(Planned(workload, name, k, None, why))
                elif not drives_several:
                    found.append(Planned(workload, name, k, ("cpu",) * k))
                elif k > 1:
                    found.append(Planned(workload, name, k, None, CPU_ONLY_REASON))
    return found


@functools.cache
def default_batch(workload: str) -> int:
    """The batch ``workload`` trains on by default: what each device gets in a full run.

    >>> default_batch("gpt")
    32
    """
    return load_workload(workload).batch_size


def kind(name: str) -> tuple[bool, bool]:
    """(takes one device only, drives several devices from one process), asked of the
    strategy itself on two CPU devices."""
    strategy = make_strategy(name)
    try:
        strategy.configure([resolve_device("cpu"), resolve_device("cpu")])
    except ConfigError:
        return True, False
    return False, len(strategy.driven_devices) > 1
