"""Small formatting helpers shared by the reports."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

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
