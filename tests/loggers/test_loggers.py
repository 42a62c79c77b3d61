"""Loggers made by name or by hand, the CSV file, and the errors of a bad request."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

import gpukit as gk
from gpukit.loggers import CsvLogger, make_loggers
from gpukit.loggers.registry import parse_names
from gpukit.train.report import read_history


def test_csv_appends_rows_and_rewrites_the_file_for_a_new_column(tmp_path: Path) -> None:
    log = CsvLogger(tmp_path)
    log.log_metrics({"loss": 1.5}, step=10)
    log.log_metrics({"loss": 1.25}, step=20)
    assert log.path.read_text().splitlines() == ["step,loss", "10,1.5", "20,1.25"]
    log.log_metrics({"val_loss": 2.0}, step=20)  # a new name: a wider header, rows kept
    log.log_metrics({"loss": 1.0, "val_loss": 1.75}, step=30)
    with open(log.path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["step", "loss", "val_loss"],
        ["10", "1.5", ""],
        ["20", "1.25", ""],
        ["20", "", "2.0"],
        ["30", "1.0", "1.75"],
    ]
    assert not list(tmp_path.glob("*.partial"))  # written aside, then renamed
    assert not list(tmp_path.glob(".*.tmp-*"))
    # The same file format as gpukit train's metrics.csv, read back by its reader.
    assert read_history(log.path)[-1] == {"step": 30, "loss": 1.0, "val_loss": 1.75}


def test_csv_hyperparams_merge_into_one_json(tmp_path: Path) -> None:
    log = CsvLogger(tmp_path)
    log.log_hyperparams({"runtime/seed": 0, "runtime/clip": None})
    log.log_hyperparams({"lr": 0.1})
    assert json.loads((tmp_path / "hyperparams.json").read_text()) == {
        "runtime/seed": 0,
        "runtime/clip": None,
        "lr": 0.1,
    }


def test_names_make_loggers_under_the_run_folder(tmp_path: Path) -> None:
    made = make_loggers(["csv", "tensorboard", "wandb", "mlflow"], tmp_path)
    assert [type(x).__name__ for x in made] == [
        "CsvLogger",
        "TensorBoardLogger",
        "WandbLogger",
        "MLflowLogger",
    ]
    csv_log, tb, wb, mlf = made
    assert csv_log.path == tmp_path / "metrics.csv"  # type: ignore[attr-defined]
    assert tb.folder == tmp_path / "tensorboard"  # type: ignore[attr-defined]
    assert wb.folder == tmp_path  # type: ignore[attr-defined]  # wandb adds its wandb/
    assert mlf.folder == tmp_path / "mlruns"  # type: ignore[attr-defined]
    assert not list(tmp_path.iterdir())  # nothing is written before the first record


def test_a_named_logger_writes_under_the_parent_of_the_checkpoints(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu", loggers="csv", checkpoints=tmp_path / "checkpoints")
    rt.log_metrics(acc=0.5)
    rt.teardown()
    assert read_history(tmp_path / "metrics.csv") == [{"step": 0, "acc": 0.5}]
    params = json.loads((tmp_path / "hyperparams.json").read_text())
    assert params["runtime/loggers"] == "csv" and params["runtime/strategy"] == "single"


def test_an_unknown_name_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(gk.ConfigError, match="unknown logger 'tb': use csv, tensorboard, wandb"):
        gk.Runtime(devices="cpu", loggers=["tb"], checkpoints=tmp_path)
    with pytest.raises(gk.ConfigError, match=r"--logger 'csv,tb': unknown logger 'tb': give a"):
        parse_names("csv,tb")


def test_a_name_without_a_folder_says_where_to_give_one() -> None:
    with pytest.raises(gk.ConfigError, match=r"the run has none: give checkpoints="):
        gk.Runtime(devices="cpu", loggers=["csv"])


def test_an_object_that_is_not_a_logger_is_refused() -> None:
    with pytest.raises(gk.ConfigError, match=r"is not a logger \(it has no log_hyperparams"):
        gk.Runtime(devices="cpu", loggers=[print])


@pytest.mark.parametrize(
    ("name", "extra", "package"),
    [
        ("tensorboard", "tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
    ],
)
def test_a_missing_package_names_the_pip_extra_when_the_logger_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, extra: str, package: str
) -> None:
    real = importlib.util.find_spec

    def find_spec(module: str, *args: Any) -> Any:
        return None if module == package else real(module, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(gk.ConfigError, match=rf'pip install "gpukit\[{extra}\]"'):
        gk.Runtime(devices="cpu", loggers=[name], checkpoints=tmp_path / "checkpoints")


def test_log_hyperparams_without_values_says_how_to_call_it() -> None:
    with pytest.raises(gk.ConfigError, match=r"rt.log_hyperparams\(\) got nothing"):
        gk.Runtime(devices="cpu").log_hyperparams()


@pytest.mark.skipif(
    importlib.util.find_spec("mlflow") is None, reason="MLflowLogger needs gpukit[mlflow]"
)  # looked up, not imported: importing mlflow starts `uname -p`
def test_mlflow_needs_one_place_for_its_runs() -> None:
    with pytest.raises(gk.ConfigError, match="MLflowLogger needs one place for its runs"):
        gk.loggers.MLflowLogger()
    with pytest.raises(gk.ConfigError, match="MLflowLogger needs one place for its runs"):
        gk.loggers.MLflowLogger("mlruns", tracking_uri="http://localhost:5000")


def test_wandb_offline_without_an_api_key_and_as_asked_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("wandb", reason="WandbLogger needs gpukit[wandb]")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    assert gk.loggers.WandbLogger().mode == "offline"
    assert gk.loggers.WandbLogger(mode="disabled").mode == "disabled"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert gk.loggers.WandbLogger().mode is None  # wandb reads WANDB_MODE itself
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert gk.loggers.WandbLogger().mode is None  # with a key: wandb's own choice


def _rank_zero_logs_at_its_epochs(rt: gk.Runtime) -> list[dict[str, float]]:
    for epoch in range(2):
        rt.barrier()  # an epoch's work
        if rt.is_global_zero:  # `if fabric.is_global_zero: fabric.log_dict(m, step=epoch)`
            rt.log_metrics(val_acc=0.5 + epoch / 4, step=epoch)
    return rt.strategy.all_gather_object(rt.history)  # type: ignore[no-any-return]


@pytest.mark.processes
def test_rank_zero_alone_logs_at_a_step_of_its_own_under_two_ranks(tmp_path: Path) -> None:
    rt = gk.Runtime(
        strategy="ddp", devices=["cpu", "cpu"], loggers="csv", checkpoints=tmp_path / "ckpt"
    )
    histories = rt.launch(_rank_zero_logs_at_its_epochs)
    want = [{"step": 0, "val_acc": 0.5}, {"step": 1, "val_acc": 0.75}]
    assert histories == [want, []]  # no collective: rank 1 neither waits nor records
    assert read_history(tmp_path / "metrics.csv") == want
