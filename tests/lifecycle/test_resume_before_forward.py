"""``resume="auto"`` in a loop that reads its batches itself (no set-up loader): the checkpoint
is loaded before the first forward of a set-up model, so the first step computes on the
resumed weights, exactly as an uninterrupted run does."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk

STEPS, SAVED_AT = 6, 3


class Offset(nn.Module):
    """A model whose backward never reads its parameter: gradients computed from a forward on
    stale weights would go unnoticed by autograd (no in-place error), only by the result."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x + self.shift) ** 2).mean()


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(8, 4, generator=gen) for _ in range(STEPS)]


def _train(
    rt: gk.Runtime,
    make: Callable[[], nn.Module],
    until: int,
    *,
    save_at: int | None = None,
    by_step: bool = False,
    resume_first: bool = False,
) -> nn.Module:
    """Forward, rt.backward, rt.step until the run's step ``until``: on one batch throughout,
    or (``by_step``) on the batch the run's step names, chosen before the forward as such
    loops choose it."""
    torch.manual_seed(0)
    net = make()
    model, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    if resume_first:
        rt.resume()
    batches = _batches()
    while rt.global_step < until:
        x = batches[rt.global_step] if by_step else batches[0]
        out = model(x)
        rt.backward(out if out.dim() == 0 else out.pow(2).mean())
        rt.step(opt)
        if rt.global_step == save_at:
            rt.save()
    return net


def _linear() -> nn.Module:
    return nn.Linear(4, 2)


def _resumed(
    tmp_path: Path, make: Callable[[], nn.Module], **loop: bool
) -> tuple[nn.Module, nn.Module]:
    """The uninterrupted run's model and the model of a run resumed from its step 3."""
    plain = gk.Runtime(devices="cpu", seed=0)
    expected = _train(plain, make, STEPS, **loop)
    plain.teardown()
    first = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path)
    _train(first, make, SAVED_AT, save_at=SAVED_AT, **loop)
    first.teardown()
    again = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, resume="auto")
    resumed = _train(again, make, STEPS, **loop)
    assert again.global_step == STEPS
    again.teardown()
    return expected, resumed


@pytest.mark.parametrize("make", [Offset, _linear], ids=["offset", "linear"])
def test_resume_auto_loads_before_the_first_forward(
    tmp_path: Path, make: Callable[[], nn.Module]
) -> None:
    with pytest.warns(UserWarning, match="resumed at step 3 at the first forward"):
        expected, resumed = _resumed(tmp_path, make)
    for a, b in zip(expected.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_loop_that_picks_its_batch_by_the_step_resumes_first_with_rt_resume(
    tmp_path: Path,
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resumed before the loop: nothing to say
        expected, resumed = _resumed(tmp_path, Offset, by_step=True, resume_first=True)
    for a, b in zip(expected.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_resume_hook_is_gone_after_the_first_forward(tmp_path: Path) -> None:
    first = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path)
    _train(first, _linear, SAVED_AT, save_at=SAVED_AT)
    first.teardown()
    rt = gk.Runtime(devices="cpu", seed=0, checkpoints=tmp_path, resume="auto")
    net = nn.Linear(4, 2)
    model, _ = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    assert len(model._forward_pre_hooks) == 1  # the resume waits for the first forward
    with torch.no_grad(), pytest.warns(UserWarning, match="rt.resume"):
        model(torch.ones(1, 4))  # an evaluation first: it sees the resumed weights
    assert rt.global_step == SAVED_AT
    assert len(model._forward_pre_hooks) == 0
    rt.teardown()


def test_no_hook_without_resume_auto() -> None:
    rt = gk.Runtime(devices="cpu")
    net = nn.Linear(4, 2)
    model = rt.setup(net)
    assert len(model._forward_pre_hooks) == 0
    rt.teardown()
