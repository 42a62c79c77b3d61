"""A strategy added from outside: one class and one registry call, then planned from its traits
and trained through the Runtime like the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk
from gpukit.devices import Device
from gpukit.errors import ConfigError, GpukitError
from gpukit.planning.targets import target
from gpukit.planning.timing import step_time
from gpukit.strategies import (
    STRATEGIES,
    Collective,
    SingleDevice,
    Strategy,
    Traits,
    register,
    traits_of,
    unregister,
)
from gpukit.workloads.base import load_workload

TOY = "toy-bucketed"


class BucketedSingle(SingleDevice):
    """Single-device training whose traits say it keeps a flat copy of the gradients (as a
    reducer's buckets) and all-reduces them once per step: the planner must count both."""

    name: ClassVar[str] = TOY
    traits: ClassVar[Traits] = Traits(
        max_devices=1,
        gradient_buckets=True,
        collectives=(Collective("all-reduce", "gradients", hidden_by="backward"),),
    )


@pytest.fixture
def toy() -> Iterator[str]:
    register(BucketedSingle)
    try:
        yield TOY
    finally:
        unregister(TOY)


def test_registering_makes_it_known_and_unregistering_forgets_it(toy: str) -> None:
    assert STRATEGIES[toy] is BucketedSingle and traits_of(toy) is BucketedSingle.traits
    assert isinstance(gk.strategies.make_strategy(toy), BucketedSingle)
    assert list(STRATEGIES)[-1] == toy  # planned and benchmarked after the built-in ones


def test_it_is_planned_by_default_from_its_traits(toy: str) -> None:
    report = gk.plan("mlp", devices=[1, 2], target="cpu", method="closed-form")
    rows = {(p.strategy, p.devices): p for p in report.plans}
    assert (toy, 1) in rows and (toy, 2) not in rows  # max_devices=1
    mine, single = rows[(toy, 1)].per_device[0], rows[("single", 1)].per_device[0]
    # Its buckets: as many bytes as the trainable gradients, beside single's breakdown.
    model = load_workload("mlp", seed=0).model
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert mine.breakdown["communication"] == trainable
    assert single.breakdown["communication"] == 0
    assert mine.peak_bytes > single.peak_bytes


def test_its_step_time_comes_from_its_collectives(toy: str) -> None:
    common = dict(
        target=target("h100"),
        devices=1,
        micro_batch=8,
        accumulate=2,
        flops_per_sample=6e12,
        trainable_bytes=4 * 10**9,
        largest_group_bytes=10**8,
        precision="bf16-mixed",
    )
    mine, _, _ = step_time(strategy=toy, **common)  # type: ignore[arg-type]
    single, _, _ = step_time(strategy="single", **common)  # type: ignore[arg-type]
    assert mine == single  # an all-reduce over one device costs nothing
    with pytest.raises(ConfigError, match="runs on one device"):
        step_time(strategy=toy, **{**common, "devices": 2})  # type: ignore[arg-type]


def test_the_simulation_runs_it_too(toy: str) -> None:
    report = gk.plan("mlp", devices=1, strategies=[toy, "single"], target="cpu")
    methods = {p.strategy: p.method for p in report.plans}
    assert methods == {toy: "simulation", "single": "simulation"}
    mine, single = (p.per_device[0].breakdown for p in report.plans)
    assert mine == single  # the simulation measures what it does: single's memory


def _losses(strategy: str) -> list[float]:
    rt = gk.Runtime(strategy=strategy, devices="cpu", seed=3)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 2, (40,), generator=g))
    model, opt, loader = rt.setup(model, opt, DataLoader(data, batch_size=8, shuffle=True))
    criterion = rt.setup_criterion(nn.functional.cross_entropy)
    losses = []
    for x, y in loader:
        loss = criterion(model(x), y)
        rt.backward(loss)
        rt.step(opt)
        losses.append(loss.item())
    rt.teardown()
    return losses


def test_it_trains_exactly_as_single_device(toy: str) -> None:
    assert gk.Runtime(strategy=toy, devices="cpu").strategy.name == toy
    assert _losses(toy) == _losses("single")


class _Unnamed(SingleDevice):
    pass


class _NoTraits(Strategy):
    name: ClassVar[str] = "toy-no-traits"

    def configure(self, devices: list[Device]) -> None:
        super().configure(devices)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return super().setup_module(module)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module


class _Incomplete(Strategy):
    name: ClassVar[str] = "toy-incomplete"
    traits: ClassVar[Traits] = Traits()


class _Taken(SingleDevice):
    name: ClassVar[str] = "ddp"


class _Auto(SingleDevice):
    name: ClassVar[str] = "auto"


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (_Taken, "'ddp' is taken by DDP"),
        (_Auto, "other than 'auto'"),
        (_NoTraits, "has no traits"),
        (_Incomplete, "does not implement configure, setup_module, unwrap"),
        (SingleDevice(), "give a subclass of gpukit.strategies.Strategy"),
        ("toy", "give a subclass"),
    ],
)
def test_a_bad_registration_says_why(cls: object, said: str) -> None:
    before = dict(STRATEGIES)
    with pytest.raises(ConfigError, match=said) as caught:
        register(cls)  # type: ignore[arg-type]
    assert isinstance(caught.value, GpukitError)
    assert before == STRATEGIES


def test_a_strategy_without_a_name_is_refused() -> None:
    _Unnamed.name = ""
    try:
        with pytest.raises(ConfigError, match="name=''"):
            register(_Unnamed)
    finally:
        del _Unnamed.name


def test_unregistering_an_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="no such strategy; registered: single, dp"):
        unregister("toy-never-registered")


def test_the_contract_requires_its_abstract_hooks() -> None:
    with pytest.raises(TypeError, match="abstract"):
        _Incomplete()  # type: ignore[abstract]
