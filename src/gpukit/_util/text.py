"""Text for reports: sizes in words, values shown in error messages, explained messages, and
tables (rich tables, rendered as plain text for ``str()``)."""

from __future__ import annotations

import io
import reprlib
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console, RenderableType
from rich.table import Table

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n: int | float | None) -> str:
    """Bytes in binary units, as people read them.

    >>> format_bytes(80 * 1024**3)
    '80 GiB'
    >>> format_bytes(1536)
    '1.5 KiB'
    """
    if n is None:
        return "?"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{int(value)} B"
            text = f"{value:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class _ShortRepr(reprlib.Repr):
    """reprlib's shortening (nested containers cut to a few items, long strings cut in the
    middle, a cycle shown as ``[...]``), with tensors shown by their metadata alone."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 6
        self.maxstring = self.maxother = self.maxlong = limit

    def repr1(self, x: object, level: int) -> str:
        if isinstance(x, torch.Tensor):
            return tensor_summary(x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple: its fields by name
            if level <= 0:
                return f"{type_name(x)}(...)"
            fields = list(zip(x._fields, x, strict=False))[: self.maxtuple]
            inner = ", ".join(f"{name}={self.repr1(value, level - 1)}" for name, value in fields)
            more = ", ..." if len(x) > self.maxtuple else ""
            return f"{type_name(x)}({inner}{more})"
        # A subclass that keeps its base's repr is shortened as the base is (and its tensors
        # shown by metadata): the base's own repr would print every tensor's values.
        shorten: dict[type, Callable[[Any, int], str]] = {
            list: self.repr_list,
            tuple: self.repr_tuple,
            dict: self.repr_dict,
            set: self.repr_set,
        }
        for base, method in shorten.items():
            if isinstance(x, base) and type(x).__repr__ is base.__repr__:
                return method(x, level)
        return super().repr1(x, level)

    def repr_instance(self, x: object, level: int) -> str:
        try:
            text = repr(x)
        except Exception:  # a __repr__ that raises
            return f"<{type_name(x)} object>"
        if len(text) > self.maxother:
            keep = max(0, (self.maxother - 3) // 2)
            return text[:keep] + "..." + text[len(text) - keep :]
        return text


def safe_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message: at most about ``limit`` characters, and never an
    error itself. A ``__repr__`` that raises gives ``<TypeName object>``, a tensor its shape,
    dtype and device (its values are never read: that would wait for the device), long or
    deeply nested values are shortened, and a repr of several lines is put on one.

    >>> class Broken:
    ...     def __repr__(self):
    ...         raise RuntimeError("no")
    >>> safe_repr(Broken())
    '<Broken object>'
    >>> safe_repr(list(range(100)))
    '[0, 1, 2, 3, 4, 5, ...]'
    >>> safe_repr(torch.zeros(2, 3))
    'tensor(shape=(2, 3), dtype=float32, device=cpu)'
    """
    try:
        text = _ShortRepr(limit).repr(value)
    except Exception:  # a __repr__ that raises, or a __class__ that lies
        return f"<{type_name(value)} object>"
    if "\n" in text:  # a message is read line by line: a multi-line repr is put on one
        text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: object) -> str:
    """The name of ``value``'s type (``type()`` cannot be fooled by a ``__class__`` property).

    >>> type_name(2.5)
    'float'
    """
    return type(value).__name__


def described(value: object, limit: int = 80) -> str:
    """A value as error messages show it: its repr, followed by its type where the repr
    leaves the type in doubt (``[1, 2] (list)``, ``3 (int64)``); a plain str, int, float,
    bool or None shows as itself.

    >>> described("cuda:1"), described(2.5), described((1,))
    ("'cuda:1'", '2.5', '(1,) (tuple)')
    """
    shown = safe_repr(value, limit)
    return shown if type(value) in _PLAIN else f"{shown} ({type_name(value)})"


_PLAIN = (str, int, float, bool, type(None))


def tensor_summary(t: torch.Tensor) -> str:
    """A tensor described from its metadata only, never its values.

    >>> tensor_summary(torch.ones(4, dtype=torch.int64))
    'tensor(shape=(4,), dtype=int64, device=cpu)'
    """
    try:
        shape = tuple(t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        return f"tensor(shape={shape}, dtype={dtype}, device={t.device})"
    except Exception:  # a tensor subclass whose metadata itself fails
        return f"<{type_name(t)} object>"


def explained(what: str, why: str, fixes: Sequence[str]) -> str:
    """An error message: what happened on the first line, then why and the numbered fixes,
    wrapped below it (the layout of gpukit's readable errors).

    >>> print(explained("it broke", "a reason", ["do this"]))
    it broke
      why: a reason
      fix:
      1. do this
    """

    def wrap(text: str, first: str, rest: str) -> list[str]:
        return textwrap.wrap(
            text, 96, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
        )

    lines = [what, *wrap(f"why: {why}", "  ", "       "), "  fix:"]
    for i, fix in enumerate(fixes, 1):
        lines += wrap(f"{i}. {fix}", "  ", "     ")
    return "\n".join(lines)


# --- tables --------------------------------------------------------------------------------------


def make_table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A rich table with one column per header entry; no header row when every entry is
    empty (a table of label/value pairs), rather than a blank row.

    >>> render_table("Summary", ["", ""], [["steps", "3"]]).splitlines()[1:]
    ['┌───────┬───┐', '│ steps │ 3 │', '└───────┴───┘']
    """
    table = Table(title=title, title_justify="left", header_style="bold", show_header=any(header))
    for name in header:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def render_plain(renderable: RenderableType, width: int = 120) -> str:
    """Render without colour or terminal codes, for ``str()`` and logs."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue().rstrip("\n")


def render_table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``make_table`` rendered as plain text."""
    return render_plain(make_table(title, header, rows))
