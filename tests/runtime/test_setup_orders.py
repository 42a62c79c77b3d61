"""rt.setup in the orders Fabric programs use: DataLoaders alone (``fabric.setup_dataloaders``)
before the model or after it, each loader sharded, on the device and checkpointed as when it
comes with the model, with the same weights bit for bit; on 1 process and 2 gloo ranks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk

ORDERS = ("together", "loaders-first", "loaders-later")
TOTAL_STEPS = 6  # 1.5 epochs of 32 samples at a global batch of 8


def _data(rt: gk.Runtime) -> tuple[DataLoader[Any], DataLoader[Any]]:
    g = torch.Generator().manual_seed(3)
    index = torch.arange(32.0)[:, None] / 32  # the first column: which sample it is
    train = TensorDataset(torch.cat([index, torch.randn(32, 3, generator=g)], dim=1))
    test = TensorDataset(torch.randn(10, 4, generator=g))
    per_rank = 8 // rt.world_size
    return DataLoader(train, batch_size=per_rank, shuffle=True), DataLoader(test, batch_size=5)


def _set_up(rt: gk.Runtime, order: str) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    train, test = _data(rt)
    if order == "together":
        model, optimizer, train, test = rt.setup(model, optimizer, train, test)
    elif order == "loaders-first":  # train, test = fabric.setup_dataloaders(train, test)
        train, test = rt.setup(train, test)
        model, optimizer = rt.setup(model, optimizer)
    else:  # model, optimizer = fabric.setup(model, optimizer); then the loaders
        model, optimizer = rt.setup(model, optimizer)
        train = rt.setup(train)
        test = rt.setup(test)
    return model, optimizer, train, test


def _one_epoch_each_order(rt: gk.Runtime) -> dict[str, Any]:
    """Each order with a model of its own in one job: the weights after one epoch, the
    samples this rank read (their first column: the sample's index) and where the batches
    were."""
    out: dict[str, Any] = {}
    for order in ORDERS:
        model, optimizer, train, test = _set_up(rt, order)
        seen: list[int] = []
        for (x,) in train:
            seen += (x[:, 0] * 32).round().long().tolist()
            rt.backward(model(x).pow(2).mean())
            rt.step(optimizer)
        with rt.evaluating(model):
            tested = sum(len(x) for (x,) in test)
        weights = [p.detach().clone() for p in rt.unwrap(model).parameters()]
        out[order] = {"weights": weights, "seen": seen, "tested": tested, "device": x.device}
    return rt.strategy.all_gather_object(out)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "devices",
    [["cpu"], pytest.param(["cpu", "cpu"], marks=pytest.mark.processes)],
    ids=["1-process", "2-process"],
)
def test_loaders_alone_before_or_after_the_model_train_as_loaders_given_with_it(
    devices: list[str],
) -> None:
    ranks = gk.Runtime(strategy="ddp", devices=devices, seed=0).launch(_one_epoch_each_order)
    for rank in ranks:
        together = rank["together"]
        for order in ORDERS[1:]:
            assert rank[order]["seen"] == together["seen"], order
            assert rank[order]["tested"] == together["tested"], order
            assert rank[order]["device"] == torch.device("cpu")
            for a, b in zip(rank[order]["weights"], together["weights"], strict=True):
                assert torch.equal(a, b), order  # bit for bit
    # Sharded: each rank reads its own samples, and together they read every one once.
    every = sorted(s for rank in ranks for s in rank["loaders-first"]["seen"])
    assert every == list(range(32))
    assert sum(rank["loaders-first"]["tested"] for rank in ranks) == 10


def _run(rt: gk.Runtime, folder: str, stop_at: int | None, resume: bool) -> dict[str, Any] | None:
    model, optimizer, train, _ = _set_up(rt, "loaders-first")
    if resume:
        rt.load(folder)
    while rt.global_step < TOTAL_STEPS:
        for (x,) in train:
            rt.backward(model(x).pow(2).mean())
            rt.step(optimizer)
            if rt.global_step == stop_at:
                rt.save(folder)
                return None
            if rt.global_step == TOTAL_STEPS:
                break
    return {k: v.numpy().copy() for k, v in rt.unwrap(model).state_dict().items()}


def test_loaders_set_up_before_the_model_resume_mid_pass(tmp_path: Path) -> None:
    """A checkpoint holds the loaders set up alone, before the model: a run stopped mid-epoch
    and loaded goes on from the same sample, to the same weights as a run never stopped."""

    def runtime() -> gk.Runtime:
        return gk.Runtime(devices="cpu", seed=0)

    straight = runtime().launch(_run, str(tmp_path / "unused"), None, False)
    assert runtime().launch(_run, str(tmp_path / "ck"), 3, False) is None  # mid-epoch 0
    resumed = runtime().launch(_run, str(tmp_path / "ck"), None, True)
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        (lambda loader, model: (), "rt.setup() got nothing"),
        (lambda loader, model: (loader, model), "the model comes first"),
        (
            lambda loader, model: (loader, torch.optim.SGD(model.parameters(), lr=0.1)),
            "got the optimizer (SGD) as argument 2 beside DataLoaders without a model",
        ),
        (lambda loader, model: (loader, [loader]), "takes DataLoaders only"),
        (lambda loader, model: ("loader",), "got 'loader' where the model goes"),
    ],
    ids=["nothing", "model-second", "optimizer", "a-list", "a-string"],
)
def test_what_cannot_go_beside_loaders_alone_is_refused_at_the_call(
    arguments: Any, needle: str
) -> None:
    rt = gk.Runtime(devices="cpu")
    loader = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2)
    with pytest.raises(gk.ConfigError, match=re.escape(needle)):
        rt.setup(*arguments(loader, nn.Linear(2, 1)))
    assert rt.loaders == []  # nothing half set up
