"""Class targets checked before the first step: both layouts, ignore_index, what is skipped."""

from __future__ import annotations

import pytest
import torch

from gpukit.errors import ConfigError
from gpukit.runtime.step.loss_targets import check_targets
from gpukit.strategies import PerDevice


def test_targets_in_range_pass_for_both_layouts() -> None:
    check_targets(torch.zeros(4, 5), torch.tensor([0, 1, 4, -100]))
    check_targets(torch.zeros(2, 5, 3, 3), torch.randint(0, 5, (2, 3, 3)))
    check_targets(torch.zeros(2, 7, 11), torch.randint(0, 11, (2, 7)))  # (B, T, C)


def test_targets_out_of_range_name_the_value_and_the_class_count() -> None:
    with pytest.raises(ConfigError) as caught:
        check_targets(torch.zeros(3, 5), torch.tensor([0, 7, 2]))
    text = str(caught.value)
    assert text.startswith("targets hold 7 but the model has 5 classes (valid 0..4)")
    assert "device-side assert" in text and "dataset's labels" in text
    assert "output layer's size: it must be at least 8" in text


def test_class_dim_one_for_images_and_last_for_sequences() -> None:
    with pytest.raises(ConfigError, match=r"targets hold 5 but the model has 5 classes"):
        check_targets(torch.zeros(2, 5, 3, 3), torch.full((2, 3, 3), 5))
    with pytest.raises(ConfigError, match=r"targets hold 11 but the model has 11 classes"):
        check_targets(torch.zeros(2, 7, 11), torch.full((2, 7), 11))  # 11 < 7 would be dim 1


def test_negative_targets_other_than_ignore_index() -> None:
    with pytest.raises(ConfigError, match=r"targets hold -1 but the model has 3 classes") as e:
        check_targets(torch.zeros(2, 3), torch.tensor([-1, 2]))
    assert "ignore_index (-100)" in str(e.value)
    check_targets(torch.zeros(2, 3), torch.tensor([-1, 2]), ignore_index=-1)
    with pytest.raises(ConfigError, match=r"targets hold -2 and 9 but"):
        check_targets(torch.zeros(3, 3), torch.tensor([-2, 9, 0]))


def test_what_cannot_be_class_targets_is_not_checked() -> None:
    check_targets(torch.zeros(3, 5), torch.full((3,), 9.0))  # regression / soft labels
    check_targets(torch.zeros(3, 5), torch.full((3, 5), 9.0))
    check_targets((torch.zeros(3, 5),), torch.tensor([9, 9, 9]))  # a tuple of outputs
    check_targets({"logits": torch.zeros(3, 5)}, torch.tensor([9, 9, 9]))
    check_targets(torch.zeros(3, 5), torch.tensor([9, 9]))  # shapes fit neither layout
    check_targets(torch.zeros(3), torch.tensor([9, 9, 9]))
    check_targets(torch.zeros(3, 5), [9, 9, 9])
    check_targets(torch.zeros(3, 5), torch.tensor([], dtype=torch.long).reshape(0))


def test_per_device_outputs_use_the_first_outputs_class_count() -> None:
    cpu = torch.device("cpu")
    out = PerDevice((torch.zeros(2, 4), torch.zeros(1, 4)), (cpu, cpu), (2, 1))
    check_targets(out, torch.tensor([0, 3, 1]))
    with pytest.raises(ConfigError, match=r"targets hold 4 but the model has 4 classes"):
        check_targets(out, torch.tensor([0, 4, 1]))


# -- which losses get the check, through rt.setup_criterion ---------------------------------------

import functools  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import gpukit as gk  # noqa: E402


def _criterion(loss: object, strategy: str = "single", devices: object = "cpu") -> object:
    return gk.Runtime(strategy=strategy, devices=devices).setup_criterion(loss)  # type: ignore[arg-type]


def test_a_loss_module_comes_back_itself_and_is_checked_once() -> None:
    ce = nn.CrossEntropyLoss(weight=torch.ones(3))
    crit = _criterion(ce)
    assert crit is ce and crit.weight.shape == (3,)  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="targets hold 5 but the model has 3 classes"):
        crit(torch.zeros(2, 3), torch.tensor([0, 5]))  # type: ignore[operator]
    assert len(ce._forward_pre_hooks) == 0  # removed at the first call, checked or not


def test_ignore_index_is_read_from_the_module_the_partial_and_the_call() -> None:
    out = torch.zeros(2, 3)
    _criterion(nn.CrossEntropyLoss(ignore_index=255))(out, torch.tensor([0, 255]))  # type: ignore[operator]
    _criterion(functools.partial(F.cross_entropy, ignore_index=255))(out, torch.tensor([0, 255]))  # type: ignore[operator]
    _criterion(F.cross_entropy)(out, torch.tensor([0, 255]), ignore_index=255)  # type: ignore[operator]
    with pytest.raises(ConfigError, match="targets hold 255"):
        _criterion(F.nll_loss)(out, torch.tensor([0, 255]))  # type: ignore[operator]


def test_other_losses_are_never_checked() -> None:
    binary = lambda o, y: F.binary_cross_entropy_with_logits(o.squeeze(1), y.float())  # noqa: E731
    assert float(_criterion(binary)(torch.zeros(3, 1), torch.tensor([0, 1, 1]))) > 0  # type: ignore[operator]
    own = lambda o, y: F.cross_entropy(o, y, ignore_index=255)  # noqa: E731
    assert float(_criterion(own)(torch.zeros(2, 3), torch.tensor([0, 255]))) >= 0  # type: ignore[operator]


def test_dp_balanced_checks_with_the_users_ignore_index() -> None:
    crit = _criterion(nn.CrossEntropyLoss(ignore_index=255), "dp-balanced", ["cpu", "cpu"])
    model = gk.Runtime(strategy="dp-balanced", devices=["cpu", "cpu"]).setup(nn.Linear(4, 3))
    assert crit(model(torch.ones(4, 4)), torch.tensor([0, 255, 2, 1])).shape == ()  # type: ignore[operator]
    bad = _criterion(nn.CrossEntropyLoss(), "dp-balanced", ["cpu", "cpu"])
    with pytest.raises(ConfigError, match="targets hold 7"):
        bad(model(torch.ones(4, 4)), torch.tensor([0, 7, 2, 1]))  # type: ignore[operator]


def test_dp_balanced_checks_every_chunks_targets() -> None:
    crit = _criterion(nn.CrossEntropyLoss(), "dp-balanced", ["cpu", "cpu"])
    model = gk.Runtime(strategy="dp-balanced", devices=["cpu", "cpu"]).setup(nn.Linear(4, 3))
    with pytest.raises(ConfigError, match="targets hold 9"):  # in the second chunk
        crit(model(torch.ones(4, 4)), torch.tensor([0, 1, 2, 9]))  # type: ignore[operator]
