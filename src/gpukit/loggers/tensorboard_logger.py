"""``TensorBoardLogger``: metrics as TensorBoard scalars, hyper-parameters in its HPARAMS tab.

Written with ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package:
``pip install "gpukit[tensorboard]"``), into one event file under ``folder``; view it with
``tensorboard --logdir FOLDER``. The writer opens at the first record (so a logger can be given
to ``gk.Runtime`` and travel to the processes ``rt.launch`` starts), and is flushed after each
record: a run that dies leaves what it logged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpukit.loggers.base import BaseLogger, plain_params, require


class TensorBoardLogger(BaseLogger):
    """Metrics and hyper-parameters to a TensorBoard event file under ``folder``."""

    name = "tensorboard"

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        require("tensorboard", "tensorboard", "TensorBoardLogger")
        self.folder = Path(folder)
        self._writer: Any = None
        self._params: dict[str, Any] = {}
        self._hparams_written = False

    def _open(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.folder))
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Keep ``params`` for TensorBoard's HPARAMS tab, written with the first metrics (or at
        the end): TensorBoard reads one set per run, the first one written, so all that came
        before are written together. After that, each call writes them all to the TEXT tab
        (``hyperparams``)."""
        self._params.update(plain_params(params))
        if self._hparams_written:
            table = "\n".join(f"| {k} | {v} |" for k, v in self._params.items())
            self._open().add_text("hyperparams", "| name | value |\n|---|---|\n" + table)
            self._open().flush()

    def _write_hparams(self) -> None:
        """The hparams summary, once, in this run's own event file (rather than the
        sub-folder ``SummaryWriter.add_hparams`` would make)."""
        if self._hparams_written or not self._params:
            return
        from torch.utils.tensorboard.summary import hparams

        writer = self._open()
        for summary in hparams(self._params, {}):
            writer.file_writer.add_summary(summary)
        self._hparams_written = True

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """A scalar per metric at ``step``."""
        self._write_hparams()
        writer = self._open()
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)
        writer.flush()

    def finalize(self, status: str) -> None:
        """Close the event file."""
        self._write_hparams()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}  # an open writer stays in its process

    def __repr__(self) -> str:
        return f"TensorBoardLogger({str(self.folder)!r})"
