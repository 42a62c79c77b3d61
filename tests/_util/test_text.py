"""Values shown in error messages: short, on one line, and never an error themselves."""

from __future__ import annotations

import pytest
import torch

import gpukit as gk
from gpukit._util.text import described, safe_repr, tensor_summary


class Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class LongRepr:
    def __repr__(self) -> str:
        return "L" * 1000


class MultiLine:
    def __repr__(self) -> str:
        return "first\n   second\nthird"


def test_a_repr_that_raises_shows_the_type() -> None:
    assert safe_repr(Unprintable()) == "<Unprintable object>"
    assert safe_repr([Unprintable()]) == "[<Unprintable object>]"
    assert described(Unprintable()) == "<Unprintable object> (Unprintable)"


def test_long_and_nested_values_are_cut() -> None:
    assert len(safe_repr(LongRepr())) <= 80
    assert len(safe_repr("x" * 10_000)) <= 80
    assert safe_repr(["cpu"] * 10**6) == "['cpu', 'cpu', 'cpu', 'cpu', 'cpu', 'cpu', ...]"
    assert len(safe_repr(10**400)) <= 80


def test_a_cycle_is_shown_without_recursing() -> None:
    loop: list[object] = []
    loop.append(loop)
    assert "..." in safe_repr(loop)


def test_a_repr_of_several_lines_comes_on_one() -> None:
    assert safe_repr(MultiLine()) == "first second third"


def test_tensors_show_metadata_and_never_their_values() -> None:
    t = torch.arange(1000)
    with gk.trace() as traced:
        shown = safe_repr(t)
    assert shown == tensor_summary(t) == "tensor(shape=(1000,), dtype=int64, device=cpu)"
    assert traced.syncs == []
    assert "meta" in safe_repr(torch.ones(2, device="meta"))


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("gpu:1", "'gpu:1'"),
        (3, "3"),
        (2.5, "2.5"),
        (None, "None"),
        (True, "True"),
        ([1], "[1] (list)"),
        (b"x", "b'x' (bytes)"),
    ],
)
def test_described_adds_the_type_where_the_repr_leaves_it_in_doubt(
    value: object, shown: str
) -> None:
    assert described(value) == shown


def test_a_table_of_label_value_pairs_has_no_blank_header_row() -> None:
    from gpukit._util.text import render_table

    lines = render_table("Training summary", ["", ""], [["steps", "3"], ["loss", "0.5"]])
    assert lines.splitlines()[-4:] == [
        "┌───────┬─────┐",
        "│ steps │ 3   │",
        "│ loss  │ 0.5 │",
        "└───────┴─────┘",
    ]
    with_header = render_table(None, ["name", ""], [["steps", "3"]])
    assert "name" in with_header.splitlines()[1]  # one named column keeps the header row
