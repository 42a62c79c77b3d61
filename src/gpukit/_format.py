"""Small formatting helpers shared by the reports."""

from __future__ import annotations

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
