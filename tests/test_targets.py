"""Class targets checked before the first step: both layouts, ignore_index, what is skipped."""

from __future__ import annotations

import pytest
import torch

from gpukit.errors import ConfigError
from gpukit.strategies import PerDevice
from gpukit.targets import check_targets


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
