"""``CsvLogger``: the metrics as one CSV file, readable while the run goes.

A row per record (``step``, then the metrics by name). Rows are appended as they come; when a
record brings a metric name the header does not have yet, the file is rewritten whole, written
aside and renamed (:func:`write_history`), so a reader never sees half a file. Hyper-parameters
go to ``hyperparams.json`` beside it.

>>> import tempfile
>>> folder = tempfile.mkdtemp()
>>> log = CsvLogger(folder)
>>> log.log_metrics({"loss": 0.5}, step=10)
>>> log.log_metrics({"loss": 0.25, "val_loss": 0.5}, step=20)
>>> log.path.read_text().splitlines()
['step,loss,val_loss', '10,0.5,', '20,0.25,0.5']
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from gpukit._util.files import append, make_folder, write_atomic
from gpukit.loggers.base import BaseLogger

_OPTION = "CsvLogger's folder"


class CsvLogger(BaseLogger):
    """Metrics to ``folder/filename`` (default ``metrics.csv``), hyper-parameters to
    ``folder/hyperparams.json``. The file is started afresh by the first record."""

    name = "csv"

    def __init__(self, folder: str | os.PathLike[str], filename: str = "metrics.csv") -> None:
        self.folder = Path(folder)
        self.path = self.folder / filename
        self._records: list[dict[str, float]] = []
        self._names: list[str] = []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Merge ``params`` into ``hyperparams.json`` (rewritten whole, aside then renamed)."""
        make_folder(self.folder, option=_OPTION)
        path = self.folder / "hyperparams.json"
        known = json.loads(path.read_text()) if path.is_file() else {}
        text = json.dumps({**known, **params}, indent=2, default=str) + "\n"
        write_atomic(path, text, option=_OPTION)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Append a row; a new metric name rewrites the file with the wider header."""
        record: dict[str, float] = {"step": step, **metrics}
        self._records.append(record)
        if not self._names or not set(metrics) <= set(self._names):
            make_folder(self.folder, option=_OPTION)
            self._names = column_names(self._records)
            write_history(self.path, self._records, _OPTION)
            return
        append(self.path, csv_text([record], self._names), option=_OPTION)

    def __repr__(self) -> str:
        return f"CsvLogger({str(self.folder)!r})"


def write_history(
    path: Path, history: list[dict[str, float]], option: str = "--out", *, sync: bool = False
) -> None:
    """Write ``history`` as a CSV (step, then the metrics by name), replacing the file whole:
    written aside and renamed, so a reader never sees half a file (a failure is an
    :class:`~gpukit.errors.OutputWriteError`, the old file kept). ``sync`` flushes it to the
    disk before the rename (a file a resumed run reads)."""
    names = column_names(history)
    write_atomic(path, csv_text(history, names, header=True), sync=sync, option=option)


def csv_text(history: list[dict[str, float]], names: list[str], *, header: bool = False) -> str:
    """``history``'s records as CSV lines (the header line first when ``header``), as
    :func:`write_rows` writes them.

    >>> csv_text([{"step": 3, "loss": 0.5}], ["loss"], header=True).splitlines()
    ['step,loss', '3,0.5']
    """
    text = io.StringIO()
    writer = csv.writer(text)
    if header:
        writer.writerow(["step", *names])
    write_rows(writer, history, names)
    return text.getvalue()


# Columns that say where a record stands come first, in this order (gpukit train's metrics.csv
# has them); the metrics follow by name, then what the Runtime measured of each window itself
# (how long its steps waited for their batches, ``gpukit.runtime.data.wait``).
FIRST_COLUMNS = ("epoch", "elapsed", "lr")
LAST_COLUMNS = ("data_wait", "data_wait_fraction", "data_wait_device", "data_wait_device_fraction")


def column_names(history: list[dict[str, float]]) -> list[str]:
    """The columns of ``history`` after ``step``: those of ``FIRST_COLUMNS`` it has, then every
    other name, sorted, then those of ``LAST_COLUMNS``.

    >>> column_names([{"step": 1, "data_wait": 0.1, "loss": 0.5, "epoch": 1, "acc": 0.9}])
    ['epoch', 'acc', 'loss', 'data_wait']
    """
    found = {k for row in history for k in row} - {"step"}
    named = sorted(found - set(FIRST_COLUMNS) - set(LAST_COLUMNS))
    first = [n for n in FIRST_COLUMNS if n in found]
    return first + named + [n for n in LAST_COLUMNS if n in found]


def write_rows(writer: Any, history: list[dict[str, float]], names: list[str]) -> None:
    """A row per record of ``history``: the step, then the values of ``names`` (blank where a
    record has none)."""
    for row in history:
        writer.writerow([int(row["step"]), *(row.get(n, "") for n in names)])
