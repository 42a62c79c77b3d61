"""What rt.backward and rt.train_step accept as a loss, judged from metadata alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.runtime.step.loss_checks import check_loss, checked_loss_fn

W = torch.ones(4, requires_grad=True)


@pytest.mark.parametrize(
    "loss",
    [
        pytest.param(lambda: (W * 2).sum(), id="scalar"),
        pytest.param(lambda: (W * 2).sum().reshape(1), id="one-element"),
        pytest.param(lambda: (W.bfloat16() * 2).sum(), id="bf16"),
        pytest.param(lambda: (W.double() * 2).sum(), id="float64"),
    ],
)
def test_a_scalar_floating_loss_on_the_graph_passes_unchanged(loss: Any) -> None:
    value = loss()
    assert check_loss(value) is value


@pytest.mark.parametrize(
    ("loss", "words"),
    [
        pytest.param(lambda: W * 2, [r"shape \(4,\)", r"\.mean\(\)"], id="vector"),
        pytest.param(
            lambda: (W * 2).sum().item(), [r"a float \(8\.0\)", r"\.item\(\)"], id="float"
        ),
        pytest.param(lambda: torch.tensor(3), ["an int64 tensor", "floating-point"], id="int"),
        pytest.param(
            lambda: (W * 2).sum().detach(), ["does not require grad", "no_grad"], id="detached"
        ),
        pytest.param(lambda: None, ["got None", "return loss"], id="none"),
        pytest.param(lambda: ((W * 2).sum(), W), ["a tuple", "tensor alone"], id="tuple"),
        pytest.param(lambda: {"loss": (W * 2).sum()}, ["a dict", "tensor alone"], id="dict"),
        pytest.param(lambda: "0.5", ["a str", "tensor your loss function"], id="str"),
        pytest.param(lambda: (W * 1j).sum(), ["complex64", "floating-point"], id="complex"),
        pytest.param(
            lambda: torch.zeros((), device="meta", requires_grad=True), ["on meta"], id="meta"
        ),
    ],
)
def test_anything_else_is_a_config_error_saying_what_it_was(loss: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"rt\.backward") as caught:
        check_loss(loss())
    for word in words:
        assert caught.match(word)


def test_the_check_never_reads_a_value_back() -> None:
    good, bad = (W * 2).sum(), W * 2
    with gk.trace() as traced:
        check_loss(good)
        with pytest.raises(ConfigError):
            check_loss(bad)
    assert traced.syncs == [] and traced.transfers == []


def test_compute_loss_is_checked_when_called_and_must_be_callable() -> None:
    checked = checked_loss_fn(lambda batch: (W * batch).sum())
    assert checked(torch.ones(4)).requires_grad
    with pytest.raises(ConfigError, match=r"compute_loss\(batch\) got a float32 tensor"):
        checked_loss_fn(lambda batch: W * batch)(torch.ones(4))
    with pytest.raises(ConfigError, match="compute_loss=5"):
        checked_loss_fn(5)  # type: ignore[arg-type]


def test_rt_backward_refuses_before_touching_its_counters() -> None:
    rt = gk.Runtime(devices="cpu")
    model = torch.nn.Linear(2, 1)
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"rt\.backward"):
        rt.backward(model(torch.ones(3, 2)))
    assert rt.micro_step == 0 and all(p.grad is None for p in model.parameters())
    rt.backward(model(torch.ones(3, 2)).mean())  # the same loop, fixed, goes on
    assert rt.micro_step == 1
