"""Slurm's compressed host lists, read without ``scontrol`` (which a node may lack).

``node[01-04,07],gpu5`` is node01, node02, node03, node04, node07 and gpu5: commas outside
brackets separate items; in brackets, numbers and ranges, whose width (zero padding) is that
of the range's first number; several bracket groups in one item multiply
(``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2).
"""

from __future__ import annotations

from collections.abc import Iterator

from gpukit.errors import ConfigError

__all__ = ["expand_hostlist", "first_host"]


def expand_hostlist(text: str, variable: str = "host list") -> list[str]:
    """The hosts of a Slurm host list, in order, zero padding kept.

    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    >>> expand_hostlist("a[1-2]-ib,b3")
    ['a1-ib', 'a2-ib', 'b3']
    """
    return list(_hosts(text, variable))


def first_host(text: str, variable: str = "host list") -> str:
    """The first host of a Slurm host list (the list is not expanded further).

    >>> first_host("gpu[007-128]")
    'gpu007'
    """
    return next(_hosts(text, variable))


def _hosts(text: str, variable: str) -> Iterator[str]:
    depth, start, items = 0, 0, []
    for i, char in enumerate(text + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise _unreadable(variable, text, "brackets do not pair up")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _unreadable(variable, text, "brackets do not pair up")
    if any(not item for item in items):
        raise _unreadable(variable, text, "an empty host name")
    for item in items:
        yield from _expand(item, variable, text)


def _expand(item: str, variable: str, text: str) -> Iterator[str]:
    """The hosts of one item: ``pre[RANGES]rest``, each bracket group multiplying."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise _unreadable(variable, text, "brackets do not pair up")
        yield item
        return
    close_at = item.find("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    tails = list(_expand(rest, variable, text))
    for part in body.split(","):
        low, dash, high = part.partition("-")
        high = high if dash else low
        if not all(n.isascii() and n.isdigit() for n in (low, high)) or int(high) < int(low):
            raise _unreadable(variable, text, f"[{body}] holds {part!r}, not a number or a range")
        for number in range(int(low), int(high) + 1):
            yield from (f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails)


def _unreadable(variable: str, text: str, why: str) -> ConfigError:
    return ConfigError(
        f"{variable}={text!r} is not a Slurm host list gpukit can read ({why}); give "
        "--master-addr (node 0's address)"
    )
