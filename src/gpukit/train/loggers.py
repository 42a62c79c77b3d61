"""``gpukit train --logger csv,tensorboard,wandb,mlflow``: the loggers of a command's run.

Each writes under ``--out DIR``, where the Runtime's named loggers write (the parent of its
checkpoints, ``DIR/checkpoints``): ``tensorboard`` in ``DIR/tensorboard/``, ``wandb`` in
``DIR/wandb/``, ``mlflow`` in ``DIR/mlruns/``. ``csv`` is ``DIR/metrics.csv``, which the
command writes with or without it (and keeps across ``--resume``), so it adds no second file.

>>> train_loggers("csv,tensorboard", out="runs/a")
['tensorboard']
>>> train_loggers(None, out=None)
[]
"""

from __future__ import annotations

from gpukit.errors import ConfigError
from gpukit.loggers.registry import parse_names


def train_loggers(text: str | None, out: str | None) -> list[str]:
    """The Runtime's ``loggers`` for ``--logger text`` (None: none) with ``--out out``."""
    if text is None:
        return []
    names = parse_names(text)
    if out is None:
        raise ConfigError(
            f"--logger {text}: loggers write under --out DIR (DIR/metrics.csv, "
            "DIR/tensorboard/, DIR/wandb/, DIR/mlruns/): add --out DIR"
        )
    return [n for n in dict.fromkeys(names) if n != "csv"]
