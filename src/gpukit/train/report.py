"""What a ``gpukit train`` run reports: its metrics, the memory of the devices it trained on,
and the files ``metrics.json``, ``metrics.csv`` and ``loss.png``.

``metrics.csv`` grows as the run goes (:class:`MetricsCsv`), so a run that dies leaves the
losses it read back; a resumed run keeps the rows up to its checkpoint's step and appends its
own, and ``loss.png`` is drawn from all of them.

>>> import json, tempfile
>>> from pathlib import Path
>>> out = Path(tempfile.mkdtemp())
>>> m = {"workload": "mlp", "strategy": "single", "world_size": 1, "precision": "32"}
>>> write_outputs(out, m, [{"step": 1.0, "loss": 0.9}, {"step": 2.0, "loss": 0.7}])
>>> (out / "metrics.csv").read_text().splitlines()
['step,loss', '1,0.9', '2,0.7']
>>> json.loads((out / "metrics.json").read_text())["workload"]
'mlp'
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gpukit._util.files import append, make_folder, replaced, write_atomic
from gpukit.diagnostics.memory import DeviceMemory, MemoryReport
from gpukit.diagnostics.memory import report as memory_report
from gpukit.errors import ConfigError
from gpukit.loggers.csv_logger import column_names, csv_text, write_history
from gpukit.runtime.runtime import Runtime
from gpukit.workloads.base import Workload
from gpukit.workloads.flops import mfu


def metrics(
    rt: Runtime,
    workload: Workload,
    *,
    samples_per_s: float,
    seconds: float,
    global_batch: int,
    memory: MemoryReport,
    config: dict[str, Any],
    history: list[dict[str, float]] | None = None,
    resumed_from_step: int | None = None,
) -> dict[str, Any]:
    """The summary of a finished run with ``rt``, as ``metrics.json`` holds it.

    ``memory`` is :func:`run_memory` of the run, ``config`` what it was asked to do (as a dict).
    MFU is given on GPUs of known peak (see :func:`gpukit.workloads.flops.mfu`), else None.
    ``history`` is the whole run's (default: what ``rt.log`` read back in this process), for
    ``final_loss``, ``final_val_loss`` and ``validation`` (each validation record, with
    ``val_accuracy`` too where the workload has it); ``resumed_from_step`` the checkpoint's
    step when the run was resumed.
    ``steps`` counts the whole run; ``seconds``, ``samples_per_s`` and ``mfu`` measure this
    session only (a resumed run may train on other devices, and a session that died left no
    time to add).

    >>> import gpukit as gk
    >>> from gpukit.workloads import load_workload
    >>> rt = gk.Runtime(devices="cpu")
    >>> m = metrics(rt, load_workload("mlp"), samples_per_s=1e3, seconds=2.0, global_batch=64,
    ...             memory=run_memory(rt), config={})
    >>> m["steps"], m["strategy"], m["mfu"], list(m["peak_memory"])
    (0, 'single', None, ['cpu'])
    """
    flops_per_s = workload.flops_per_sample * samples_per_s
    # PEAK_FLOPS lists GPUs: a CPU's model name must not match one of them by chance.
    utilisation = (
        mfu(flops_per_s, rt.device_info.name, gpu_count(rt)) if rt.device.type == "cuda" else None
    )
    records = rt.history if history is None else history
    losses = [r["loss"] for r in records if "loss" in r]
    validation = [validation_record(r) for r in records if "val_loss" in r]
    last = validation[-1] if validation else {}
    return {
        "workload": workload.name,
        "data": workload.data or None,
        "final_loss": losses[-1] if losses else None,
        "final_val_loss": last.get("val_loss"),
        "final_val_accuracy": last.get("val_accuracy"),
        "validation": validation,
        "steps": rt.global_step,
        "resumed_from_step": resumed_from_step,
        "samples_per_s": samples_per_s,
        "seconds": seconds,
        "global_batch": global_batch,
        "world_size": rt.world_size,
        "strategy": rt.strategy.name,
        "precision": rt.precision.name,
        "devices": [str(d) for d in rt.strategy.devices],
        # The device's model (a GPU's name): what gpukit report plans the run for.
        "device_name": rt.device_info.name,
        "mfu": utilisation,
        "peak_memory": {_row_name(row): row.peak for row in memory.rows},
        "memory": memory.to_dict(),
        "micro_batch": -(-global_batch // (rt.world_size * rt.accumulate * rt.oom_split)),
        "oom_retries": rt.oom_events,
        "config": config,
    }


def data_wait(history: list[dict[str, float]], seconds: float) -> dict[str, float | None]:
    """How long this session's steps waited for their batches, as ``metrics.json`` holds it:
    ``data_wait``, the seconds of every window of ``history`` (this process's records; see
    :mod:`gpukit.runtime.data.wait`) added up; ``data_wait_fraction``, that over ``seconds``
    (the training time ``samples_per_s`` is measured over); ``data_wait_device``, on CUDA, the
    seconds the device waited for the batches' copies. None where nothing was measured.

    >>> data_wait([{"step": 10, "data_wait": 0.5}, {"step": 20, "data_wait": 1.5}], 20.0)
    {'data_wait': 2.0, 'data_wait_fraction': 0.1, 'data_wait_device': None}
    """
    host = [r["data_wait"] for r in history if "data_wait" in r]
    device = [r["data_wait_device"] for r in history if "data_wait_device" in r]
    waited = sum(host) if host else None
    return {
        "data_wait": waited,
        "data_wait_fraction": waited / seconds if waited is not None and seconds else None,
        "data_wait_device": sum(device) if device else None,
    }


def validation_record(record: Mapping[str, float]) -> dict[str, float]:
    """A validation record of the history as ``metrics.json`` lists it: its step, epoch and
    values.

    >>> validation_record({"step": 32, "epoch": 1, "lr": 0.003, "val_loss": 0.5})
    {'step': 32, 'epoch': 1, 'val_loss': 0.5}
    """
    first = {k: record[k] for k in ("step", "epoch") if k in record}
    return {**first, **{k: v for k, v in record.items() if k.startswith("val_")}}


def learning_rate(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``{"lr": ...}``: the first parameter group's learning rate as the optimizer holds it on
    the host (none for a rate kept in a device tensor: reading it would wait for the device).

    >>> learning_rate(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
    {'lr': 0.5}
    """
    lr = optimizer.param_groups[0].get("lr")
    if isinstance(lr, torch.Tensor):
        return {"lr": float(lr)} if lr.device.type == "cpu" else {}
    return {"lr": float(lr)} if isinstance(lr, (int, float)) else {}


def gpu_count(rt: Runtime) -> int:
    """GPUs a run with ``rt`` trains on over all its processes, for MFU: one per process under
    DDP, and every device of a single process that drives several (dp).

    >>> import gpukit as gk
    >>> gpu_count(gk.Runtime(strategy="dp", devices="cpu,cpu,cpu"))
    3
    """
    return rt.world_size * len(rt.strategy.driven_devices)


def run_memory(rt: Runtime) -> MemoryReport:
    """Memory of every device the run trained on: all of a dp run's GPUs, each rank's under
    DDP (gathered, so every rank must call it), the process's RAM on a CPU.

    >>> import gpukit as gk
    >>> [row.device for row in run_memory(gk.Runtime(devices="cpu")).rows]
    ['cpu']
    """
    used = [d.torch for d in rt.strategy.driven_devices if d.type == "cuda"]
    return memory_report(used or ["cpu"])


def with_peak_tensors(
    rt: Runtime, memory: MemoryReport, peaks: Mapping[str, int | None]
) -> MemoryReport:
    """``memory`` (:func:`run_memory`'s rows, every rank's) with each row's ``peak_tensors``:
    ``peaks`` is this rank's, by device
    (:meth:`gpukit.diagnostics.peak_tensors.PeakTensors.result`).
    Every rank's values are gathered in one collective, so **every rank must call it**; each
    rank sends its own rows' values, in their order, so the gathered values line up with the
    rows.

    >>> import gpukit as gk
    >>> rt = gk.Runtime(devices="cpu")
    >>> [r.peak_tensors for r in with_peak_tensors(rt, run_memory(rt), {"cpu": 4096}).rows]
    [4096]
    """
    own = [r for r in memory.rows if r.rank in (None, rt.rank)]
    sent = [float(v) if (v := peaks.get(r.device)) is not None else -1.0 for r in own]
    # float64: exact for any size a device holds; -1: not measured.
    gathered = rt.all_gather(torch.tensor(sent, dtype=torch.float64)).reshape(-1).tolist()
    values = [int(v) if v >= 0 else None for v in gathered]
    # strict: every rank sends as many values as it has rows.
    pairs = zip(memory.rows, values, strict=True)
    return MemoryReport(tuple(dataclasses.replace(r, peak_tensors=v) for r, v in pairs))


def _row_name(row: DeviceMemory) -> str:
    return row.device if row.rank is None else f"{row.device} (rank {row.rank})"


def write_outputs(
    out: Path,
    metrics: dict[str, Any],
    history: list[dict[str, float]],
    resumed_from_step: int | None = None,
) -> None:
    """metrics.json, metrics.csv (the logged ``history``) and loss.png under ``out``; the plot
    marks ``resumed_from_step`` when given."""
    make_folder(out)
    # Each replaced whole (written aside, renamed): a failure keeps the previous file whole.
    write_history(out / "metrics.csv", history)
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    _plot_loss(out / "loss.png", history, metrics, resumed_from_step)


class MetricsCsv:
    """``metrics.csv`` kept as the run goes: the rows a flush reads back are appended at once.

    ``resumed_from_step`` None starts the file afresh. A step (the checkpoint's, on resume)
    keeps the file's rows up to that step and drops later ones: a run that died after its
    last checkpoint logged them, and this run trains those steps again, so each step is in
    the file once. ``stamp(record)``, when given, adds columns to each new row as it is
    written (``gpukit train``: its epoch, the seconds since the run started, the learning
    rate); :attr:`elapsed` is the last ``elapsed`` of the rows kept (0.0 without one).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
    >>> write_history(path, [{"step": 10.0, "loss": 0.9}, {"step": 20.0, "loss": 0.8}])
    >>> log = MetricsCsv(path, resumed_from_step=10)
    >>> log.update([{"step": 15.0, "loss": 0.85}], stamp=lambda r: {"epoch": 2})
    >>> path.read_text().splitlines()
    ['step,epoch,loss', '10,,0.9', '15,2,0.85']
    """

    def __init__(self, path: Path, resumed_from_step: int | None) -> None:
        self.path = path
        past = read_history(path) if resumed_from_step is not None else []
        self.rows = [r for r in past if r["step"] <= (resumed_from_step or 0)]
        self.elapsed = next((r["elapsed"] for r in reversed(self.rows) if "elapsed" in r), 0.0)
        self._names = column_names(self.rows)
        self._seen = 0  # records of this run's history already in the file
        make_folder(path.parent)
        # A resumed run reads it back: the rows it keeps reach the disk before the rename.
        write_history(path, self.rows, sync=True)

    def update(
        self,
        history: list[dict[str, float]],
        stamp: Callable[[dict[str, float]], dict[str, float]] | None = None,
    ) -> None:
        """Add the records of ``history`` (this run's, as it grows) not yet in the file."""
        new = history[self._seen :]
        if not new:
            return
        self._seen = len(history)
        if stamp is not None:
            new = [{**r, **stamp(r)} for r in new]
        self.rows += new
        names = column_names(new)
        if not set(names) <= set(self._names):  # a new column: the header changes
            self._names = column_names(self.rows)
            write_history(self.path, self.rows, sync=True)
            return
        append(self.path, csv_text(new, self._names))

    def whole(self, history: list[dict[str, float]]) -> list[dict[str, float]]:
        """The whole run's records as the file holds them: the kept rows of earlier runs,
        then those of ``history`` (with their stamps)."""
        self.update(history)
        return list(self.rows)


def read_history(path: Path) -> list[dict[str, float]]:
    """The records of a metrics.csv (none when there is no file).

    >>> import tempfile
    >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
    >>> write_history(path, [{"step": 1.0, "loss": 0.5}, {"step": 2.0, "acc": 0.25}])
    >>> read_history(path)
    [{'step': 1, 'loss': 0.5}, {'step': 2, 'acc': 0.25}]
    """
    if not path.exists():
        return []
    records: list[dict[str, float]] = []
    with open(path, newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            try:
                record = {k: float(v) for k, v in row.items() if k and v not in ("", None)}
                for count in ("step", "epoch"):  # counts, as the run writes them
                    if count in record:
                        record[count] = int(record[count])
                records.append(record)
            except (ValueError, OverflowError) as err:  # OverflowError: a step of inf
                raise ConfigError(
                    f"{path}, line {line}: {err}: metrics.csv holds numbers only (as gpukit "
                    "train writes it); repair the line, or move the file away to start it afresh"
                ) from None
            if "step" not in records[-1]:
                raise ConfigError(
                    f"{path}, line {line}: no step: this is not a metrics.csv that gpukit train "
                    "wrote; move it away to start it afresh"
                )
    return records


def _plot_loss(
    path: Path,
    history: list[dict[str, float]],
    metrics: dict[str, Any],
    resumed_from_step: int | None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    rows = [r for r in history if "loss" in r]
    checked = [r for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".", label="training")
    if checked:  # a second series on the same step axis: the validation loss at each pass
        ax.plot(
            [r["step"] for r in checked],
            [r["val_loss"] for r in checked],
            marker="o",
            label="validation",
        )
    if resumed_from_step is not None:
        ax.axvline(resumed_from_step, color="grey", linestyle=":", label="resumed")
    if checked or resumed_from_step is not None:
        ax.legend(loc="upper right")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(
        f"{metrics['workload']}: {metrics['strategy']} x{metrics['world_size']}, "
        f"{metrics['precision']}"
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with replaced(path) as temporary:
            fig.savefig(temporary, dpi=100, format="png")
    finally:
        plt.close(fig)
