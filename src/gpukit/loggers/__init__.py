"""Loggers: where a run's hyper-parameters and metrics go besides ``rt.history``.

``gk.Runtime(loggers=[...])`` takes names (``"csv"``, ``"tensorboard"``, ``"wandb"``,
``"mlflow"``, written under the run's folder: see :mod:`gpukit.loggers.registry`) or logger
objects: :class:`CsvLogger`, :class:`TensorBoardLogger`, :class:`WandbLogger`,
:class:`MLflowLogger`, or one's own (three methods: :mod:`gpukit.loggers.base`). Rank 0 gives
them what ``rt.history`` gains, already read back: a logger adds no work to the step. The
third-party packages are imported only when a logger first writes.
"""

from gpukit.loggers.base import BaseLogger, Logger
from gpukit.loggers.csv_logger import CsvLogger
from gpukit.loggers.mlflow_logger import MLflowLogger
from gpukit.loggers.registry import NAMES, make_loggers
from gpukit.loggers.tensorboard_logger import TensorBoardLogger
from gpukit.loggers.wandb_logger import WandbLogger

__all__ = [
    "NAMES",
    "BaseLogger",
    "CsvLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "make_loggers",
]
