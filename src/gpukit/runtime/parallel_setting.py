"""The ``parallel`` setting: one device mesh of every parallelism dimension, named by sizes.

``gk.Runtime(parallel={"tp": 2, "pp": 2})`` trains with ``gk.strategies.Parallel`` over that
layout (the sizes of ``dp_replicate``, ``dp_shard``, ``tp``, ``pp`` and ``cp``, one of them
-1 for what the others leave; ``dp_shard`` is -1 unless given), with the strategy's other
keywords beside them (``pp_schedule``, ``float8``...). ``"auto"``: the planner chooses the
layout for the model at ``rt.setup``. ``gpukit train`` builds the mapping from its flags
(``--tp 2 --pp 2``) and config files from their keys.

>>> check_parallel({"tp": 2})
>>> check_parallel({"tp": "two"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
gpukit.errors.ConfigError: parallel tp='two': give a whole number of ranks, ...
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.strategies import Layout, Parallel, Strategy

AUTO = "auto"


def check_parallel(value: object) -> None:
    """Refuse a ``parallel`` that is not None, "auto", or a mapping of known keywords whose
    sizes make a layout (the ranks are checked when the devices are known)."""
    if value is None or (isinstance(value, str) and value == AUTO):
        return
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"parallel={described(value)}: give a dict of dimension sizes such as "
            '{"tp": 2, "pp": 2} (dp_replicate, dp_shard, tp, pp, cp; one may be -1), "auto" '
            "(the planner chooses), or None"
        )
    keywords = set(inspect.signature(Parallel).parameters)
    unknown = sorted(str(k) for k in value if k not in keywords)
    if unknown:
        raise ConfigError(
            f"parallel: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"{', '.join(sorted(keywords))}"
        )
    Layout.of({k: v for k, v in value.items() if k in Layout.__dataclass_fields__})


def check_with_strategy(parallel: object, strategy: object) -> None:
    """``parallel`` names the strategy itself: refuse another one given beside it."""
    if parallel is not None and not (isinstance(strategy, str) and strategy == AUTO):
        raise ConfigError(
            f"parallel={described(parallel)} and strategy={described(strategy)} were both "
            "given: parallel= trains with gk.strategies.Parallel over its layout; drop "
            "strategy= (or give strategy=gk.strategies.Parallel(...) without parallel=)"
        )


def parallel_strategy(parallel: object) -> Strategy | None:
    """The strategy ``parallel`` asks for (None: the ``strategy`` setting decides)."""
    if parallel is None:
        return None
    if isinstance(parallel, str):  # "auto": a layout of every rank sharding, until rt.setup
        return Parallel(layout=AUTO)
    assert isinstance(parallel, Mapping)  # check_parallel refused anything else
    return Parallel(**dict(parallel))


def from_flags(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``parallel`` mapping of ``gpukit train``'s flags (``--tp 2`` gives ``tp: 2``);
    None when none of them was given."""
    given = {k: v for k, v in values.items() if v is not None}
    return given or None


__all__ = ["check_parallel", "check_with_strategy", "from_flags", "parallel_strategy"]
