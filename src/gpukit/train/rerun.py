"""``config.toml``: the run ``gpukit train`` made, as a config file that makes it again.

``gpukit train --out DIR`` writes ``DIR/config.toml`` when the run starts: every flag of the
run with the value it used (the workload's learning rate, batch size and epochs where none was
given, the strategy and precision the Runtime chose), keyed by the flag's long name with
underscores, as ``gpukit train --config`` reads it. ``gpukit train --config DIR/config.toml
--out OTHER`` trains the same run again (``--resume`` and ``--overwrite`` are left out: they
say what to do with a folder, not what to train). ``metrics.json`` holds the same values under
``config`` (and every setting of the Runtime under ``config.runtime``).

>>> print(to_toml({"workload": "mlp", "lr": 0.003, "max_steps": None, "compile": False}))
# gpukit train --config FILE: the flags of a run, by their long names with underscores
workload = "mlp"
lr = 0.003
compile = false
<BLANKLINE>
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpukit.runtime import settings
from gpukit.train import options

HEADER = "# gpukit train --config FILE: the flags of a run, by their long names with underscores"


def rerun_flags(
    recorded: Mapping[str, Any], precision: str, strategy_options: object = None
) -> dict[str, Any]:
    """The flags that train the run again, from its record (``metrics.json``'s ``config``):
    the run's own (:func:`gpukit.train.options.for_rerun`; those the strategy reads, such as
    fsdp's ``activation_checkpointing``, as ``strategy_options``, the strategy's ``options``,
    holds them), then every Runtime setting that has a flag (``precision``: the one the Runtime
    chose). None: left out.

    >>> recorded = {"workload": "mlp", "lr": 0.003, "seed": 0, "progress_every": 30.0,
    ...             "runtime": {"strategy": "single", "precision": "auto",
    ...                         "devices": ["cpu", "cpu"], "seed": 0, "clip": None}}
    >>> rerun_flags(recorded, "32")
    {'workload': 'mlp', 'lr': 0.003, 'progress_every': 30.0, 'strategy': 'single', \
'precision': '32', 'devices': 'cpu,cpu', 'seed': 0}
    """
    out: dict[str, Any] = {}
    # The mesh flags are Parallel's, whose options hold a layout: fsdp's hold a tp too (1),
    # which the rerun would take for --tp 1 beside --strategy fsdp, and refuse.
    layout = hasattr(strategy_options, "dp_shard")
    for f in options.for_rerun():
        name = options.option(f).strategy_option
        if f.name in options.MESH_FLAGS and not layout:
            continue
        if name is None:
            out[f.name] = recorded.get(f.name)
        else:
            out[f.name] = _strategy_value(f, getattr(strategy_options, name, None))
    runtime = recorded.get("runtime", {})
    for f in settings.fields():
        if settings.option(f).flag and f.name in runtime:
            out[f.name] = precision if f.name == "precision" else runtime[f.name]
    return {k: _flag_value(v) for k, v in out.items() if v is not None}


def _strategy_value(f: Any, value: object) -> Any:
    """The strategy's ``value`` of the option ``f`` as its flag gives it; None where no flag
    value gives it (fsdp's ``mixed`` as a MixedPrecisionPolicy object: only "bf16" has one)."""
    if value is None:
        return None
    if options.is_switch(f):
        return bool(value)  # fsdp's compile="blocks": the switch that made it
    allowed = options.option(f).choices
    return None if allowed is not None and value not in allowed else value


def _flag_value(value: Any) -> Any:
    """A recorded value as its flag takes it: a list of devices as the text "a,b"."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return ",".join(str(v) for v in value)
    return value


def to_toml(values: Mapping[str, Any]) -> str:
    """``values`` (bools, numbers and text; None left out) as TOML, one ``key = value`` a
    line under a comment line."""
    lines = [HEADER]
    for key, value in values.items():
        if value is None:
            continue
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back as the same float
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
