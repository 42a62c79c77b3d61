"""TensorBoard, MLflow and W&B loggers, read back with each library's own reader: what a run
of ``gk.Runtime`` recorded in ``rt.history`` is what the tracker holds, step for step."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit.loggers import Logger, MLflowLogger, TensorBoardLogger, WandbLogger


def _train(logger: Logger) -> list[dict[str, float]]:
    """Six steps logged every two, a validation value, one hyper-parameter; the history."""
    rt = gk.Runtime(devices="cpu", log_every=2, seed=0, loggers=[logger])

    def main(rt: gk.Runtime) -> list[dict[str, float]]:
        net = torch.nn.Linear(3, 1)
        model, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        rt.log_hyperparams(lr=0.1, layers=1)
        for _ in range(6):
            loss = model(torch.ones(4, 3)).pow(2).mean()
            rt.backward(loss)
            rt.step(opt)
            rt.log(loss=loss)
        rt.log_metrics(val_loss=0.75)
        return rt.history

    history: list[dict[str, float]] = rt.launch(main)  # finalizes the loggers
    rt.teardown()
    return history


def _series(history: list[dict[str, float]], name: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), r[name]) for r in history if name in r]


def test_tensorboard_holds_the_history_and_the_hyperparameters(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoardLogger needs gpukit[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    history = _train(TensorBoardLogger(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name in ("loss", "val_loss"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        want = _series(history, name)
        assert [s for s, _ in got] == [s for s, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32
    params: dict[str, Any] = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                params[key] = getattr(value, value.WhichOneof("kind"))
    assert params["lr"] == 0.1 and params["layers"] == 1
    assert params["runtime/strategy"] == "single" and params["runtime/seed"] == 0


@pytest.mark.processes  # mlflow asks `uname -p` about the machine
def test_mlflow_holds_the_history_and_the_parameters(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="MLflowLogger needs gpukit[mlflow]")
    from mlflow.tracking import MlflowClient

    logger = MLflowLogger(tmp_path / "mlruns", experiment="tests")
    history = _train(logger)
    client = MlflowClient(tracking_uri=logger.tracking_uri)
    run = client.get_run(str(logger.run_id))
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    for name in ("loss", "val_loss"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert got == _series(history, name)  # float64 all the way: equal
    params = run.data.params
    assert params["lr"] == "0.1" and params["runtime/log_every"] == "2"


@pytest.mark.processes
def test_mlflow_marks_a_failed_run(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="MLflowLogger needs gpukit[mlflow]")
    from mlflow.tracking import MlflowClient

    logger = MLflowLogger(tmp_path / "mlruns")
    rt = gk.Runtime(devices="cpu", loggers=[logger])

    def main(rt: gk.Runtime) -> None:
        rt.log_metrics(loss=1.0)
        raise KeyError("the program's own failure")

    with pytest.raises(KeyError):
        rt.launch(main)
    run = MlflowClient(tracking_uri=logger.tracking_uri).get_run(str(logger.run_id))
    assert run.info.status == "FAILED"


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file, parsed with wandb's own protocol buffers. The file is
    a LevelDB-style log (a 7-byte header, then 32 KiB blocks of chunks: CRC-32, length, type),
    which this wandb version reads only in its Go core."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@pytest.mark.processes  # wandb runs its core in a process of its own
def test_wandb_offline_holds_the_history_and_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="WandbLogger needs gpukit[wandb]")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="tests", folder=tmp_path)
    assert logger.mode == "offline"  # no API key: no network, no login prompt
    history = _train(logger)
    (found,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # run.finish() returns before wandb's core process has written the file out: wait for
    # the run's exit record (the file is complete then), as `wandb sync` later would find it.
    deadline = time.monotonic() + 120
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(found)):
        assert time.monotonic() < deadline, "wandb never wrote the run's exit record"
        time.sleep(0.1)
    records = _wandb_records(found)
    logged: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, Any] = {}
    exit_codes = []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    logged.setdefault(key, []).append((record.history.step.num, value))
        elif kind in ("config", "run"):
            update = record.config.update if kind == "config" else record.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
        elif kind == "exit":
            exit_codes.append(record.exit.exit_code)
    assert [r.run.project for r in records if r.WhichOneof("record_type") == "run"] == ["tests"]
    assert logged == {"loss": _series(history, "loss"), "val_loss": _series(history, "val_loss")}
    assert config["lr"] == 0.1 and config["runtime/strategy"] == "single"
    assert exit_codes == [0]


def test_tensorboard_hyperparameters_given_late_go_to_the_text_tab(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoardLogger needs gpukit[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.log_hyperparams({"epochs_done": 1})  # the HPARAMS set is written already
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (text,) = events.Tensors("hyperparams/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "| lr | 0.1 |" in table and "| epochs_done | 1 |" in table


def test_a_step_of_its_own_reaches_tensorboard_and_one_that_goes_back_is_written(
    tmp_path: Path,
) -> None:
    """``fabric.log_dict({"val_loss": v}, step=epoch)`` ported as ``rt.log_metrics``: the
    event carries the given step; a step lower than the last is written too, and TensorBoard's
    reader keeps it (docs/loggers.md says what each tracker does)."""
    pytest.importorskip("tensorboard", reason="TensorBoardLogger needs gpukit[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rt = gk.Runtime(devices="cpu", loggers=[TensorBoardLogger(tmp_path)])
    for epoch in range(3):
        rt.log_metrics(val_loss=1.0 / (epoch + 1), step=epoch * 10)
    rt.log_metrics(val_loss=4.0, step=15)  # back below 20
    rt.teardown()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [
        (0, 1.0),
        (10, 0.5),
        (20, pytest.approx(1 / 3)),
        (15, 4.0),
    ]
