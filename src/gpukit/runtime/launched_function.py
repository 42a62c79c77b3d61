"""What each rank runs for ``rt.launch(fn, *args)``: the function, then the run's end that every
rank reaches together.

Module level, and apart from the Runtime, so that a rank started as a new interpreter
(``rt.launch``'s spawn) can import it by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def then_close_window(fn: Callable[..., Any], rt: Any, *args: Any) -> Any:
    """``fn(rt, *args)``, then the last logging window read back: every rank that returns
    normally reaches this point. The loggers are finalized here, as failed when ``fn``
    raised. ``rt`` is the Runtime (not named as a type: the Runtime's module imports this
    one)."""
    try:
        result = fn(rt, *args)
        rt._logging.close_window()
    except BaseException:
        rt._reporting.finish("failed")
        raise
    rt.lifecycle.finished(rt.global_step)
    rt._reporting.finish("success")
    return result
