"""A workload that cannot train is refused when it loads, before any process starts."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpukit.errors import ConfigError
from gpukit.workloads import Workload, base, load_workload


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    yield tmp_path
    for name in ("wl_raises", "wl_syntax"):
        sys.modules.pop(name, None)


def test_a_function_that_raises_names_its_line_and_keeps_the_error(module_dir: Path) -> None:
    (module_dir / "wl_raises.py").write_text("def make():\n    return 1 / 0\n")
    with pytest.raises(ConfigError, match=r"make\(\) failed \(at .*wl_raises\.py, line 2\)") as e:
        load_workload("wl_raises:make")
    assert "ZeroDivisionError" in str(e.value)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_syntax_error_is_two_lines_with_file_line_and_the_text(module_dir: Path) -> None:
    (module_dir / "wl_syntax.py").write_text("x = 1\ndef make(:\n    pass\n")
    with pytest.raises(ConfigError) as e:
        load_workload("wl_syntax:make")
    first, second = str(e.value).splitlines()
    assert (
        first.endswith("wl_syntax.py:2: SyntaxError: invalid syntax") or "wl_syntax.py:2" in first
    )
    assert "def make(:" in second and "fix" in second


def load_returning(monkeypatch: pytest.MonkeyPatch, result: Any) -> Workload:
    """load_workload on a built-in name whose builder returns ``result``."""
    monkeypatch.setattr(base, "_builtin", lambda name: lambda: result)
    return load_workload("mlp")


@pytest.mark.parametrize(
    "item",
    [
        pytest.param((torch.ones(2), torch.ones(1)), id="tensors"),
        pytest.param((np.ones(2, dtype=np.float32), np.float32(1.0)), id="numpy"),
        pytest.param(([1.0, 2.0], 3), id="numbers"),
        pytest.param(({"a": torch.ones(2), "b": torch.ones(2)}, torch.ones(1)), id="dict-input"),
        pytest.param([torch.ones(2), torch.ones(1)], id="list-pair"),
    ],
)
def test_items_the_loader_can_stack_are_accepted(
    monkeypatch: pytest.MonkeyPatch, item: Any
) -> None:
    loaded = load_returning(monkeypatch, (nn.Linear(2, 1), [item] * 4, nn.MSELoss()))
    assert len(loaded.dataset) == 4  # type: ignore[arg-type]


def test_a_workload_object_is_checked_like_a_tuple(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = TensorDataset(torch.ones(0, 2), torch.ones(0, 1))
    workload = Workload("w", nn.Linear(2, 1), empty, nn.MSELoss(), 4, 0.1, 1, 0.0)
    with pytest.raises(ConfigError, match=r"workload 'w': the dataset \(TensorDataset\) is empty"):
        load_returning(monkeypatch, workload)
