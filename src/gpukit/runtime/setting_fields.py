"""How one setting of :class:`~gpukit.runtime.settings.Settings` is declared: a dataclass field
whose metadata is its :class:`Option` (help, allowed values, check, flag, ``gpukit train``'s own
default and why), made by :func:`setting`.

>>> import dataclasses
>>> @dataclasses.dataclass
... class Example:
...     seed: int = setting(0, help="the seed", allowed="an int")
>>> dataclasses.fields(Example)[0].metadata["option"].help
'the seed'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SAME: Any = object()  # gpukit train's default is the API's


@dataclass(frozen=True)
class Option:
    """What a :class:`Settings` field says about itself (see the module docstring)."""

    help: str  # one line: --help and the table
    allowed: str  # the values it takes, in words
    doc: str = ""  # the longer text of gk.Runtime's docstring (default: help)
    check: Callable[[Any], None] | None = None  # raises ConfigError for a bad value
    flag: bool = True  # gpukit train has --name-with-dashes for it
    no_flag: str = ""  # without a flag: what gpukit train does instead
    parse: Callable[[str], Any] = str  # the flag's text to the value
    choices: tuple[str, ...] | None = None  # the flag's closed set of values
    metavar: str | None = None
    train_default: Any = SAME
    why: str = ""  # why gpukit train's default differs from the API's


def setting(default: Any, **option: Any) -> Any:
    """A :class:`Settings` field: its default and its :class:`Option`."""
    return field(default=default, metadata={"option": Option(**option)})
