"""Tables for reports: rich tables, rendered as plain text for ``str()``."""

from __future__ import annotations

import io
from collections.abc import Sequence

from rich.console import Console, RenderableType
from rich.table import Table


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
