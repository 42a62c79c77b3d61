"""gk.Runtime's loggers: rank 0 forwards what rt.history gains, with no added read, copy or
collective; hyper-parameters at the start; finalized once; a failing logger stops the run
naming itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit.loggers import BaseLogger, CsvLogger
from gpukit.train.report import read_history

STEPS, LOG_EVERY = 30, 10


class Recorder:
    """One's own logger, written to the protocol alone (no base class)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.calls.append(("hyperparams", dict(params)))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("metrics", {"step": step, **metrics}))

    def finalize(self, status: str) -> None:
        self.calls.append(("finalize", status))

    def of(self, kind: str) -> list[Any]:
        return [value for k, value in self.calls if k == kind]


class Failing(BaseLogger):
    name = "flaky-disk"

    def __init__(self, fail_in: str) -> None:
        self.fail_in = fail_in

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.fail_in == "log_metrics":
            raise OSError(28, "No space left on device")

    def finalize(self, status: str) -> None:
        raise OSError(28, "No space left on device")


def _loop(rt: gk.Runtime, steps: int = STEPS) -> None:
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.01))
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(steps)]
    for x, y in batches:
        loss = torch.nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        rt.log(loss=loss, scale=torch.tensor(float(rt.rank)))


def _traced(loggers: list[Any]) -> tuple[list[tuple[str, int, str]], list[dict[str, float]]]:
    rt = gk.Runtime(devices="cpu", log_every=LOG_EVERY, loggers=loggers)
    _loop(rt, steps=2)  # first-step checks are one-time
    rt.flush_logs()
    with gk.trace() as t:
        _loop(rt)
    return [(s.op, s.count, s.function) for s in t.syncs], rt.history


def test_loggers_add_no_read_copy_or_collective(tmp_path: Path) -> None:
    plain, history = _traced([])
    recorder = Recorder()
    logged, logged_history = _traced([CsvLogger(tmp_path), recorder])
    assert logged == plain  # the same reads, at the same places
    assert sum(count for _, count, _ in logged) == STEPS // LOG_EVERY  # one read per flush
    assert logged_history == history
    assert recorder.of("metrics") == history  # every record, as rt.history holds it
    assert read_history(tmp_path / "metrics.csv") == history


def test_a_users_logger_gets_the_settings_its_hyperparameters_records_and_the_end() -> None:
    recorder = Recorder()
    rt = gk.Runtime(devices="cpu", log_every=5, seed=3, loggers=[recorder])

    def main(rt: gk.Runtime) -> list[dict[str, float]]:
        rt.log_hyperparams({"lr": 0.01}, batch=16)
        _loop(rt, steps=12)  # 2 flushes; the last 2 steps flush when main returns
        rt.log_metrics(val_loss=torch.tensor(0.5))
        return rt.history

    history = rt.launch(main)
    rt.teardown()  # finalized once, already
    settings, own = recorder.of("hyperparams")
    assert settings["runtime/seed"] == 3 and settings["runtime/log_every"] == 5
    assert settings["runtime/strategy"] == "single"
    assert own == {"lr": 0.01, "batch": 16}
    metrics = recorder.of("metrics")
    assert [r["step"] for r in metrics] == [5, 10, 12, 12]
    assert metrics == history and metrics[2] == {"step": 12, "val_loss": 0.5}
    assert recorder.of("finalize") == ["success"]
    assert recorder.calls[-1] == ("finalize", "success")


def test_teardown_finalizes_a_loop_without_launch() -> None:
    recorder = Recorder()
    rt = gk.Runtime(devices="cpu", log_every=5, loggers=recorder)
    _loop(rt, steps=5)
    rt.teardown()
    rt.teardown()
    assert recorder.of("finalize") == ["success"]
    assert len(recorder.of("metrics")) == 1


def test_teardown_while_an_error_goes_out_finalizes_as_failed() -> None:
    recorder = Recorder()
    rt = gk.Runtime(devices="cpu", log_every=5, loggers=recorder)
    with pytest.raises(KeyError):
        try:
            _loop(rt, steps=5)
            raise KeyError("the program's own failure")
        finally:
            rt.teardown()
    assert recorder.of("finalize") == ["failed"]


def test_a_failing_logger_stops_the_run_naming_itself_and_keeps_the_history() -> None:
    recorder = Recorder()
    rt = gk.Runtime(devices="cpu", log_every=5, loggers=[recorder, Failing("log_metrics")])
    with pytest.raises(gk.LoggerError) as caught:
        rt.launch(_loop)
    message = str(caught.value)
    assert "logger flaky-disk failed in log_metrics at step 5: OSError" in message
    assert "No space left on device" in message and "loggers=" in message
    assert isinstance(caught.value.__cause__, OSError)
    assert [r["step"] for r in rt.history] == [5]  # the record is kept
    # The others are told the run failed; the failing one's finalize error is only logged.
    assert recorder.of("finalize") == ["failed"]


def test_a_failing_finalize_is_an_error_when_the_run_succeeded() -> None:
    rt = gk.Runtime(devices="cpu", log_every=5, loggers=[Failing("finalize")])
    with pytest.raises(gk.LoggerError, match="logger flaky-disk failed in finalize"):
        rt.launch(_loop, 5)


def _two_ranks(rt: gk.Runtime, folder: str) -> list[dict[str, float]]:
    _loop(rt, steps=20)
    return rt.history


class PerRankFile(BaseLogger):
    """Writes a file named after the process's rank: shows which ranks wrote."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        path = self.folder / f"rank{os.environ.get('RANK', '?')}.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


@pytest.mark.processes
def test_only_rank_0_writes_and_the_values_are_the_averaged_history(tmp_path: Path) -> None:
    rt = gk.Runtime(
        strategy="ddp",
        devices=["cpu", "cpu"],
        log_every=LOG_EVERY,
        loggers=["csv", PerRankFile(tmp_path)],
        checkpoints=tmp_path / "checkpoints",
    )
    history = rt.launch(_two_ranks, str(tmp_path))  # rank 0's
    assert [p.name for p in tmp_path.glob("rank*.jsonl")] == ["rank0.jsonl"]
    written = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert written == history
    assert [r["scale"] for r in history] == [0.5, 0.5]  # ranks 0 and 1, averaged
    assert read_history(tmp_path / "metrics.csv") == history
    params = json.loads((tmp_path / "hyperparams.json").read_text())
    assert params["runtime/strategy"] == "ddp"


@pytest.mark.processes
def test_import_gpukit_imports_no_tracker() -> None:
    code = (
        "import sys, gpukit; "
        "print([m for m in ('tensorboard', 'wandb', 'mlflow') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_logger_failing_at_teardown_is_raised_after_the_teardown() -> None:
    rt = gk.Runtime(devices="cpu", log_every=5, loggers=[Failing("finalize")])
    _loop(rt, steps=5)
    with pytest.raises(gk.LoggerError, match="logger flaky-disk failed in finalize"):
        rt.teardown()
    assert not rt.state.modules  # the models were dropped all the same
