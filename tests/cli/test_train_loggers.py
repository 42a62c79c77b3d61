"""`gpukit train --logger`: the loggers write under --out, csv is metrics.csv itself, and a
bad request is one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpukit.cli.__main__ import main
from gpukit.train.report import read_history


def test_tensorboard_writes_under_out_and_csv_is_metrics_csv(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="--logger tensorboard needs gpukit[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    argv = ["train", "--workload", "mlp", "--max-steps", "6", "--log-every", "2"]
    assert main([*argv, "--out", str(out), "--logger", "csv,tensorboard"]) == 0
    rows = read_history(out / "metrics.csv")
    history = [r for r in rows if "loss" in r]  # the validation pass has a row of its own
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in scalars] == [int(r["step"]) for r in history] == [2, 4, 6]
    assert [v for _, v in scalars] == pytest.approx([r["loss"] for r in history], rel=1e-6)
    # the validation loss reaches TensorBoard too, at the step it was measured
    validation = [(int(r["step"]), r["val_loss"]) for r in rows if "val_loss" in r]
    logged = events.Scalars("val_loss")
    assert [e.step for e in logged] == [step for step, _ in validation] == [6]
    assert [e.value for e in logged] == pytest.approx([v for _, v in validation], rel=1e-6)
    # the run's own values are its hyper-parameters, besides the Runtime's settings
    from tensorboard.plugins.hparams import plugin_data_pb2

    params = {}
    for content in events.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            for key, value in data.session_start_info.hparams.items():
                params[key] = getattr(value, value.WhichOneof("kind"))
    assert params["workload"] == "mlp" and params["batch_size"] == 64 and params["lr"] > 0
    assert params["runtime/strategy"] == "single"
    # csv adds no second file: metrics.csv is it.
    assert sorted(p.name for p in out.glob("*.csv")) == ["metrics.csv"]
    assert not (out / "hyperparams.json").exists()


def test_logger_without_out_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--workload", "mlp", "--max-steps", "1", "--logger", "csv"]) == 2
    err = capsys.readouterr().err
    assert "--logger csv: loggers write under --out DIR" in err
    assert len(err.strip().splitlines()) == 1


def test_an_unknown_logger_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--workload", "mlp", "--max-steps", "1", "--out", str(out)]
    assert main([*argv, "--logger", "csv,neptune"]) == 2
    err = capsys.readouterr().err
    assert "unknown logger 'neptune': give a comma list of csv, tensorboard, wandb, mlflow" in err
    assert not out.exists()


def test_each_rank_of_a_job_gets_the_logger_flag() -> None:
    import argparse

    from gpukit.cli.train import _worker_command, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "--out", "runs/a", "--logger", "tensorboard,mlflow"])
    command = _worker_command(args, "ddp")
    assert command[command.index("--logger") + 1] == "tensorboard,mlflow"
