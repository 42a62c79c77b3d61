"""``Parallel(layout="auto")``: the sizes of a layout chosen for the model at ``rt.setup``,
by the function the planner installs when ``gpukit`` is imported (strategies cannot import
the planner, which sits above them).

>>> check_auto("auto", tp=1)
>>> check_auto("auto", tp=2)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
gpukit.errors.ConfigError: Parallel(layout='auto', tp=2): 'auto' chooses every size; ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies.layout import Layout

Chooser = Callable[..., tuple[dict[str, int], str]]
_CHOOSER: list[Chooser] = []


def use_layout_chooser(chooser: Chooser) -> None:
    """Install the function that answers ``layout="auto"`` (the planner's): given the model,
    the number of ranks and this rank's device (and, by keyword, the run's
    ``activation_checkpointing`` and ``float8``), the sizes of each dimension and one line
    saying why."""
    _CHOOSER[:] = [chooser]


def check_auto(layout: object, **sizes: int) -> None:
    """``layout`` is "auto" (or None), and then no size is given beside it."""
    if not (isinstance(layout, str) and layout == "auto"):
        raise ConfigError(
            f"Parallel(layout={described(layout)}): give 'auto' (the planner chooses the "
            "sizes at rt.setup), or leave it out and give the sizes"
        )
    given = {k: v for k, v in sizes.items() if v != Layout.__dataclass_fields__[k].default}
    if given:
        shown = ", ".join(f"{k}={v}" for k, v in given.items())
        raise ConfigError(
            f"Parallel(layout='auto', {shown}): 'auto' chooses every size; drop {shown}, or "
            "drop layout='auto' to use them"
        )


def ask_chooser(*args: Any, **kwargs: Any) -> tuple[dict[str, int], str]:
    """The installed chooser's answer (see :func:`use_layout_chooser`)."""
    if not _CHOOSER:
        raise ConfigError(
            'parallel layout="auto" needs gpukit\'s planner: import gpukit (not only '
            "gpukit.strategies), or give the sizes"
        )
    return _CHOOSER[0](*args, **kwargs)


__all__ = ["ask_chooser", "check_auto", "use_layout_chooser"]
