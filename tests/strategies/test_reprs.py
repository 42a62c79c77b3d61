"""``print(rt)``, ``print(rt.strategy)`` and ``print(rt.precision)`` say what they are: the
strategy, its processes and devices, the precision, this process's rank."""

from __future__ import annotations

import pytest

import gpukit as gk
from gpukit.strategies.ddp import DDP


@pytest.mark.parametrize(
    "keywords, runtime, strategy, precision",
    [
        (
            {"devices": "cpu"},
            "Runtime(strategy=single, devices=1, precision=32, rank=0/1)",
            "SingleDevice(world_size=1, device=cpu)",
            "Precision(32, device=cpu)",
        ),
        (
            {"strategy": "ddp", "devices": ["cpu", "cpu"], "precision": "bf16-mixed"},
            "Runtime(strategy=ddp, devices=2, precision=bf16-mixed, rank=0/2)",
            "DDP(world_size=2, rank=0, device=cpu)",
            "BF16Mixed(bf16-mixed, device=cpu)",
        ),
        (
            {"strategy": "fsdp", "devices": ["cpu", "cpu"]},
            "Runtime(strategy=fsdp, devices=2, precision=32, rank=0/2)",
            "FSDP(world_size=2, rank=0, device=cpu)",
            "Precision(32, device=cpu)",
        ),
        (
            {"strategy": "dp", "devices": ["cpu", "cpu"]},
            "Runtime(strategy=dp, devices=2, precision=32, rank=0/1)",
            "DP(world_size=1, devices=[cpu, cpu])",
            "Precision(32, device=cpu)",
        ),
        (
            {"strategy": "dp-balanced", "devices": ["cpu", "cpu"]},
            "Runtime(strategy=dp-balanced, devices=2, precision=32, rank=0/1)",
            "DPBalanced(world_size=1, devices=[cpu, cpu])",
            "Precision(32, device=cpu)",
        ),
    ],
)
def test_each_strategy_and_precision_and_the_runtime_read_as_what_they_are(
    keywords: dict[str, object], runtime: str, strategy: str, precision: str
) -> None:
    rt = gk.Runtime(**keywords)  # type: ignore[arg-type]
    assert (repr(rt), repr(rt.strategy), repr(rt.precision)) == (runtime, strategy, precision)
    assert str(rt) == repr(rt)


def test_a_strategy_not_yet_given_devices_says_so() -> None:
    assert repr(DDP()) == "DDP(world_size=1, device=none)"


def _seen_by_every_rank(rt: gk.Runtime) -> list[str]:
    return rt.strategy.all_gather_object(f"{rt} {rt.strategy}")


@pytest.mark.processes
def test_each_rank_of_a_launched_run_names_itself() -> None:
    seen = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"]).launch(_seen_by_every_rank)
    assert seen == [
        "Runtime(strategy=ddp, devices=2, precision=32, rank=0/2) "
        "DDP(world_size=2, rank=0, device=cpu)",
        "Runtime(strategy=ddp, devices=2, precision=32, rank=1/2) "
        "DDP(world_size=2, rank=1, device=cpu)",
    ]
