"""The one walker: every container kind, types kept, aliases kept, and everyone uses it."""

from __future__ import annotations

import ast
import collections
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from gpukit._util import tree
from gpukit.errors import ConfigError


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    tag: str = "t"
    derived: int = dataclasses.field(init=False, default=7)


class ReadOnly(Mapping[str, Any]):
    """A Mapping that is not a dict, built from one."""

    def __init__(self, items: dict[str, Any]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def nested() -> Any:
    shared = torch.ones(2)
    return {
        "pair": Pair(torch.zeros(2), shared),
        "frozen": Frozen(torch.full((2,), 3.0)),
        "list": [shared, "text", 3],
        "default": collections.defaultdict(list, {"k": torch.ones(1)}),
        "ordered": collections.OrderedDict(z=torch.ones(1)),
        "mapping": ReadOnly({"m": torch.ones(3)}),
    }


def test_tensors_finds_every_tensor_in_every_container() -> None:
    found = list(tree.tensors(nested()))
    assert len(found) == 7  # the shared tensor twice


def test_map_keeps_every_container_type_and_aliases() -> None:
    obj = nested()
    out = tree.map_tensors(obj, lambda t: t * 2)
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].x, torch.zeros(2))
    assert isinstance(out["frozen"], Frozen) and out["frozen"].derived == 7
    assert torch.equal(out["frozen"].a, torch.full((2,), 6.0))
    assert out["list"][1:] == ["text", 3]
    assert out["list"][0] is out["pair"].y  # one tensor in, one tensor out
    assert isinstance(out["default"], collections.defaultdict)
    assert out["default"].default_factory is list
    assert isinstance(out["ordered"], collections.OrderedDict)
    assert isinstance(out["mapping"], ReadOnly) and torch.equal(
        out["mapping"]["m"], 2 * torch.ones(3)
    )
    assert obj["frozen"].a[0] == 3.0  # the input is untouched


def test_zip_map_combines_like_structures() -> None:
    a = Frozen(torch.zeros(1), tag="a")
    b = Frozen(torch.ones(1), tag="b")
    out = tree.zip_map([{"f": a}, {"f": b}], torch.cat)
    assert out["f"].tag == "a" and out["f"].a.tolist() == [0.0, 1.0]


def test_no_other_module_walks_nested_data_by_hand() -> None:
    """Walking containers recursively happens in the walker only: a hand-written one elsewhere
    is how the loader once missed the tensors of dataclass batches."""
    src = Path(tree.__file__).resolve().parents[1]
    offenders = []
    for path in src.rglob("*.py"):
        if path.name == "tree.py":
            continue
        module = ast.parse(path.read_text())
        for fn in ast.walk(module):
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls_itself = any(
                isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == fn.name
                for n in ast.walk(fn)
            )
            checks_containers = any(
                isinstance(n, ast.Name) and n.id in ("Mapping", "dict", "list", "tuple")
                for call in ast.walk(fn)
                if isinstance(call, ast.Call)
                and isinstance(call.func, ast.Name)
                and call.func.id == "isinstance"
                for n in ast.walk(call)
            )
            if calls_itself and checks_containers:
                offenders.append(f"{path.relative_to(src)}:{fn.name}")
    assert not offenders, f"walk nested data with gpukit._util.tree instead: {offenders}"


# -- data that cannot be walked ------------------------------------------------------------------


def _loop() -> list[Any]:
    loop: list[Any] = [torch.ones(1)]
    loop.append(loop)
    return loop


def _deep(levels: int) -> Any:
    value: Any = torch.ones(1)
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize(
    "walk",
    [
        pytest.param(lambda obj: list(tree.tensors(obj)), id="tensors"),
        pytest.param(lambda obj: tree.map_tensors(obj, lambda t: t), id="map_tensors"),
        pytest.param(lambda obj: tree.zip_map([obj, obj], torch.cat), id="zip_map"),
    ],
)
def test_a_cycle_is_an_error_naming_its_path(walk: Any) -> None:
    with pytest.raises(ConfigError, match=r"data\[1\] is data again \(a cycle\)"):
        walk(_loop())
    inner: dict[str, Any] = {"x": torch.ones(1)}
    outer = {"batch": [inner]}
    inner["up"] = outer
    with pytest.raises(ConfigError, match=r"data\.batch\[0\]\.up is data again"):
        walk(outer)


def test_data_nested_too_deeply_says_how_deep() -> None:
    with pytest.raises(ConfigError, match=r"nested too deeply to walk: 3001 levels"):
        tree.map_tensors(_deep(3000), lambda t: t)
    assert len(list(tree.tensors(_deep(50)))) == 1  # deep, but walkable


def test_shared_parts_are_not_a_cycle() -> None:
    shared = [torch.ones(1)]
    moved = tree.map_tensors({"a": shared, "b": shared}, lambda t: t + 1)
    assert moved["a"][0] is moved["b"][0]


class Unreadable(list):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("cannot iterate")


def test_a_container_that_raises_is_a_config_error_and_fn_errors_pass_through() -> None:
    with pytest.raises(ConfigError, match="failed with RuntimeError: cannot iterate") as caught:
        tree.map_tensors({"a": Unreadable([torch.ones(1)])}, lambda t: t)
    assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(ConfigError, match="cannot iterate"):
        list(tree.tensors([Unreadable()]))

    def fails(t: torch.Tensor) -> torch.Tensor:
        raise ValueError("from fn")

    with pytest.raises(ValueError, match="from fn"):
        tree.map_tensors([torch.ones(1)], fails)


def test_mapped_tensors_are_freed_when_dropped_not_at_the_next_collection() -> None:
    """The walker recurses through itself; its memo must not keep what it mapped alive in a
    reference cycle (a batch moved to the device would outlive its step until a collection)."""
    import gc
    import weakref

    gc.disable()
    try:
        out = tree.map_tensors({"x": torch.ones(3)}, lambda t: t * 2)
        alive = weakref.ref(out["x"])
        del out
        assert alive() is None
    finally:
        gc.enable()
