"""Text for reports: sizes in words, explained messages, and tables (rich tables, rendered as
plain text for ``str()``)."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence

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
    """A rich table with one column per header entry."""
    table = Table(title=title, title_justify="left", header_style="bold")
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
