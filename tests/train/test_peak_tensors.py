"""gpukit train's peak of tensor memory per device: the number, its window, and its cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.diagnostics import peak_tensors as measure
from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.diagnostics.memory import DeviceMemory, MemoryReport
from gpukit.diagnostics.peak_tensors import MEASURED_STEPS, PeakTensors
from gpukit.train.loop import RUNTIME_DEFAULTS, TrainConfig, fit
from gpukit.train.report import run_memory, with_peak_tensors
from gpukit.workloads import Workload, load_workload


def _by_hand(workload_name: str) -> int:
    """The measuring sequence, written out: model and AdamW built, counter on, watch, setup,
    watch, file_made, then the first steps with batches from the loader."""
    workload = load_workload(workload_name, seed=0)
    rt = gk.Runtime(**RUNTIME_DEFAULTS)
    optimizer = torch.optim.AdamW(workload.model.parameters(), lr=workload.lr)
    loader = torch.utils.data.DataLoader(
        workload.dataset, batch_size=workload.batch_size, shuffle=True, drop_last=True
    )
    live = LiveTensors()
    with live:
        live.watch(workload.model, [optimizer])
        model, optimizer, loader = rt.setup(workload.model, optimizer, loader)
        live.watch(rt.unwrap(model), [optimizer])
        live.file_made("communication")
        criterion = rt.setup_criterion(workload.loss)
        for _, batch in zip(range(MEASURED_STEPS), loader, strict=False):
            loss = rt.train_step(optimizer, batch, lambda b: criterion(model(b[0]), b[1]))
            rt.log(loss=loss)
    return live.peak["cpu"]


def test_train_writes_the_cpu_peak_counted_over_the_first_steps(tmp_path: Path, capsys) -> None:
    assert main(["train", "--workload", "mlp", "--max-steps", "4", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "metrics.json").read_text())["memory"]["devices"]
    assert row["device"] == "cpu" and isinstance(row["peak_tensors"], int)
    assert row["peak_tensors"] > 0
    assert row["peak_tensors"] == _by_hand("mlp")
    assert "peak tensors" in capsys.readouterr().out  # the summary's memory table shows it


def _dying(seed: int) -> Workload:
    """Fails in its second step: inside the measuring window."""
    calls = [0]

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("the machine went away")
        return torch.nn.functional.mse_loss(out, target)

    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(seed))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return Workload("dying", torch.nn.Linear(4, 1), data, loss, 16, 0.05, 1, 0.0)


def test_the_counter_is_off_after_the_window_and_after_a_failure() -> None:
    resize = torch.UntypedStorage.resize_
    counting: list[bool] = []

    def loss(b: Any) -> torch.Tensor:
        counting.append(any(isinstance(m, LiveTensors) for m in _get_current_dispatch_mode_stack()))
        return torch.nn.functional.mse_loss(model(b[0]), b[1])

    rt = gk.Runtime(devices="cpu", seed=0)
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    peaks = PeakTensors(["cpu"])
    peaks.start(net, optimizer)
    model, optimizer = rt.setup(net, optimizer)
    peaks.after_setup(rt.unwrap(model), optimizer)
    for _ in range(MEASURED_STEPS + 2):
        rt.train_step(optimizer, (torch.ones(8, 4), torch.ones(8, 1)), loss)
        peaks.after_step()
    assert counting == [True] * MEASURED_STEPS + [False, False]  # in the window only
    assert _get_current_dispatch_mode_stack() == [] and torch.UntypedStorage.resize_ is resize
    assert not peaks.active and peaks.result()["cpu"] > 0
    config = TrainConfig(workload="tests.train.test_peak_tensors:_dying", progress=False)
    with pytest.raises(RuntimeError, match="went away"):
        gk.Runtime(devices="cpu", seed=0).launch(fit, config)
    assert _get_current_dispatch_mode_stack() == [] and torch.UntypedStorage.resize_ is resize


def _reads_and_copies(monkeypatch: pytest.MonkeyPatch, steps: int) -> tuple[int, int]:
    monkeypatch.setattr(measure, "MEASURED_STEPS", steps)
    config = TrainConfig(workload="mlp", max_steps=6, progress=False, sample=False)
    with gk.trace() as t:
        metrics = gk.Runtime(devices="cpu", seed=0, log_every=2).launch(fit, config)
    (row,) = metrics["memory"]["devices"]
    assert (row["peak_tensors"] is None) == (steps == 0)
    return sum(s.count for s in t.syncs), len(t.transfers)


def test_the_window_adds_no_read_and_no_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    without = _reads_and_copies(monkeypatch, 0)
    assert without[0] >= 3  # the loss read back every 2 steps: the count sees reads
    assert _reads_and_copies(monkeypatch, MEASURED_STEPS) == without


def test_cuda_peaks_are_reset_at_the_start_and_read_once_at_the_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str]] = []

    def reset(device: str) -> None:
        calls.append(("reset", str(device)))

    def read(device: str) -> int:
        calls.append(("read", str(device)))
        return 1000 + int(str(device)[-1])

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", read)
    peaks = PeakTensors([torch.device("cuda", 0), torch.device("cuda", 1)])  # dp: every GPU
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    peaks.start(model, optimizer)
    assert calls == [("reset", "cuda:0"), ("reset", "cuda:1")]
    assert _get_current_dispatch_mode_stack() == []  # no op-by-op counting on CUDA
    peaks.after_setup(model, optimizer)
    assert peaks.result() == {"cuda:0": None, "cuda:1": None}
    for _ in range(MEASURED_STEPS - 1):
        peaks.after_step()
    assert len(calls) == 2  # no read per step
    peaks.after_step()
    assert calls[2:] == [("read", "cuda:0"), ("read", "cuda:1")]
    for _ in range(3):
        peaks.after_step()
    peaks.stop()
    assert len(calls) == 4  # once per run
    assert peaks.result() == {"cuda:0": 1000, "cuda:1": 1001}


def test_rows_get_their_peaks_and_old_reports_still_read() -> None:
    rt = gk.Runtime(devices="cpu")
    (row,) = with_peak_tensors(rt, run_memory(rt), {"cpu": None}).rows
    assert row.peak_tensors is None
    old = {"devices": [{k: v for k, v in row.to_dict().items() if k != "peak_tensors"}]}
    report = MemoryReport.from_dict(old)  # a metrics.json written before the field existed
    assert report.rows[0].peak_tensors is None and "peak tensors" not in str(report)
    measured = MemoryReport((DeviceMemory("cpu", None, 1, 1, 2, None, None, None, 4096),))
    assert "peak tensors" in str(measured) and "4 KiB" in str(measured)
    assert MemoryReport.from_dict(measured.to_dict()) == measured


@pytest.mark.processes
def test_two_ddp_ranks_each_measure_their_own_device(tmp_path: Path) -> None:
    argv = ["train", "--workload", "mlp", "--devices", "2", "--strategy", "ddp"]
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", *argv, "--max-steps", "4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "metrics.json").read_text())["memory"]["devices"]
    assert [(r["device"], r["rank"]) for r in rows] == [("cpu", 0), ("cpu", 1)]
    assert all(isinstance(r["peak_tensors"], int) and r["peak_tensors"] > 0 for r in rows)
    assert "peak tensors" in done.stdout
