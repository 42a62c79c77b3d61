"""A loop moved onto gpukit computes exactly what the plain PyTorch loop computes, bit for bit:
the same weights, buffers and random stream, whatever the out-of-memory setting (its snapshot
reads the random generators, it never draws from them) and with clipping or accumulation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk

STEPS = 6


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen))
        for _ in range(STEPS)
    ]


def _state(model: nn.Module) -> dict[str, Any]:
    return {
        "tensors": {k: v.clone() for k, v in model.state_dict().items()},
        "rng": torch.get_rng_state(),
    }


def _plain(clip: float | None = None, accumulate: int = 1) -> dict[str, Any]:
    """What a user writes without gpukit (the PyTorch tutorials' loop)."""
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(_batches()):
        loss = nn.functional.cross_entropy(model(x), y)
        (loss / accumulate if accumulate > 1 else loss).backward()
        if (i + 1) % accumulate == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return _state(model)


def _gpukit(train_step: bool, **options: Any) -> dict[str, Any]:
    rt = gk.Runtime(devices="cpu", precision="32", **options)
    torch.manual_seed(0)
    net = _model()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    criterion = rt.setup_criterion(nn.CrossEntropyLoss())
    for x, y in _batches():
        if train_step:
            loss = rt.train_step(optimizer, (x, y), lambda b: criterion(model(b[0]), b[1]))
        else:
            loss = criterion(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)
        rt.log(loss=loss)
    return _state(rt.unwrap(model))


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    for name, t in a["tensors"].items():
        assert torch.equal(t, b["tensors"][name]), name
    assert torch.equal(a["rng"], b["rng"]), "the random stream moved differently"


@pytest.mark.parametrize("oom", ["raise", "auto", "recover"])
def test_train_step_equals_the_plain_loop(oom: str) -> None:
    _assert_same(_gpukit(True, oom=oom), _plain())


def test_backward_and_step_equal_the_plain_loop() -> None:
    _assert_same(_gpukit(False), _plain())


def test_clipping_equals_clip_grad_norm() -> None:
    _assert_same(_gpukit(False, clip=0.5), _plain(clip=0.5))
    _assert_same(_gpukit(True, clip=0.5, oom="recover"), _plain(clip=0.5))


def test_accumulation_equals_dividing_the_loss() -> None:
    _assert_same(_gpukit(False, accumulate=2), _plain(accumulate=2))
