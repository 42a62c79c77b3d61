"""gk.to: copy semantics, nested containers, aliasing, modules, non_blocking."""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import gpukit as gk

Pair = namedtuple("Pair", "x y")


@dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: list = field(default_factory=list)
    cached: int = field(default=0, init=False)


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def test_tensor_already_there_is_the_same_object() -> None:
    x = torch.arange(4.0)
    assert gk.to(x, "cpu") is x
    assert gk.to(x, gk.cpu()) is x


def test_copy_true_allocates_new_storage_with_equal_values() -> None:
    x = torch.arange(4.0)
    y = gk.to(x, "cpu", copy=True)
    assert y is not x and y.data_ptr() != x.data_ptr() and torch.equal(x, y)
    y[0] = 100
    assert x[0] == 0


def test_nested_containers_keep_their_types() -> None:
    x = torch.ones(2)
    batch = {"a": [x, (x, 3)], "b": Pair(x, "s"), "c": OrderedDict(k=x), "n": None}
    out = gk.to(batch, "cpu")
    assert type(out["a"]) is list and type(out["a"][1]) is tuple
    assert isinstance(out["b"], Pair) and out["b"].y == "s" and out["b"].x is x
    assert type(out["c"]) is OrderedDict and out["c"]["k"] is x
    assert out["n"] is None and out["a"][1][1] == 3


def test_copy_reaches_every_tensor_in_a_structure_and_keeps_aliases() -> None:
    x = torch.ones(2)
    out = gk.to({"a": x, "b": [x]}, "cpu", copy=True)
    assert out["a"] is not x and out["a"] is out["b"][0]


def test_dataclasses_including_frozen_and_init_false_fields() -> None:
    x = torch.ones(2)
    b = Batch(x, "cat", [x])
    b.cached = 7
    out = gk.to(b, "cpu", copy=True)
    assert isinstance(out, Batch) and out is not b and out.label == "cat" and out.cached == 7
    assert out.x is not x and out.extra[0] is out.x
    assert b.x is x  # the input is left alone
    frozen = gk.to(Frozen(x), "cpu", copy=True)
    assert isinstance(frozen, Frozen) and frozen.x is not x


def test_defaultdict_keeps_its_factory() -> None:
    d: defaultdict[str, list] = defaultdict(list, a=torch.ones(1))
    out = gk.to(d, "cpu")
    assert isinstance(out, defaultdict) and out["missing"] == []


def test_module_moves_in_place_or_as_a_copy() -> None:
    model = nn.Linear(2, 2)
    assert gk.to(model, "cpu") is model
    copied = gk.to(model, "cpu", copy=True)
    assert copied is not model and copied.weight.data_ptr() != model.weight.data_ptr()
    assert torch.equal(copied.weight, model.weight)


def test_tensor_to_meta_device_is_refused_as_a_device() -> None:
    with pytest.raises(gk.DeviceError, match="meta"):
        gk.to(torch.ones(1), "meta")


def test_missing_target_raises_before_touching_anything(cpu_only) -> None:
    x = torch.ones(1)
    with pytest.raises(gk.DeviceError, match="CPU-only"):
        gk.to({"x": x}, "gpu:0")


def test_non_blocking_defaults_to_pinned_cpu_to_cuda_only(fake_gpus, monkeypatch) -> None:
    fake_gpus(1)
    calls: list[tuple[str, bool]] = []

    def fake_to(self, target, non_blocking=False, copy=False):
        calls.append((str(target), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: bool(getattr(self, "pin", 0)))
    pinned, pageable = torch.ones(1), torch.ones(1)
    pinned.pin = 1  # type: ignore[attr-defined]
    gk.to([pinned, pageable], "gpu:0")
    gk.to(pinned, "gpu:0", non_blocking=False)
    gk.to(pageable, "gpu:0", non_blocking=True)
    assert calls == [("cuda:0", True), ("cuda:0", False), ("cuda:0", False), ("cuda:0", True)]


@pytest.mark.gpu
def test_real_gpu_round_trip_and_identity() -> None:
    x = torch.arange(8.0).pin_memory()
    y = gk.to(x, "gpu:0")
    assert y.device.type == "cuda" and gk.to(y, "/gpu:0") is y
    z = gk.to(y, "/gpu:0", copy=True)
    assert z is not y and z.data_ptr() != y.data_ptr()
    assert torch.equal(gk.to(z, "cpu"), x)
