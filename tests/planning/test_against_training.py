"""The planner against training: for every built-in workload, single, ddp and fsdp on 1 and 2
ranks (gloo), the simulated peak of each rank equals the `peak_tensors` that `gpukit train`
measures over the same steps (within 0.01%: the fake and the real forward differ by a few
bytes of scalars in cnn's batch norm); the closed form stays within 15%."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.bench.plan import STEPS, measured_peaks
from gpukit.cli.__main__ import main
from gpukit.planning.closed_form import closed_form, model_facts
from gpukit.planning.facts import ModelFacts
from gpukit.planning.simulate import simulate
from gpukit.workloads.base import load_workload

WORKLOADS = ("mlp", "cnn", "gpt")
SRC = Path(__file__).resolve().parents[2] / "src"


@functools.cache
def workload_facts(name: str) -> tuple[int, ModelFacts]:
    """The workload's batch and its closed-form facts: the same for every strategy and rank
    count, so made once per workload in this module (building cnn makes its images)."""
    workload = load_workload(name, seed=0)
    return workload.batch_size, model_facts(workload.model, workload.dataset[0], loss=workload.loss)


def predicted(name: str, strategy: str, ranks: int) -> tuple[int, int]:
    batch, facts = workload_facts(name)
    micro = batch // ranks
    sim = simulate(name, strategy=strategy, devices=ranks, micro_batch=micro)[0].peak_bytes
    form = max(
        p.peak_bytes
        for p in closed_form(facts, strategy=strategy, devices=ranks, micro_batch=micro)
    )
    return sim, form


def trained_in_process(name: str, strategy: str, out: Path) -> int:
    device = ["--devices", "cpu"] if strategy == "single" else ["--devices", "1"]
    argv = ["train", "--workload", name, "--max-steps", str(STEPS), "--precision", "32"]
    assert main([*argv, "--strategy", strategy, *device, "--out", str(out)]) == 0
    (row,) = json.loads((out / "metrics.json").read_text())["memory"]["devices"]
    return int(row["peak_tensors"])


@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_one_rank_prediction_equals_the_measured_peak(
    name: str, strategy: str, tmp_path: Path
) -> None:
    measured = trained_in_process(name, strategy, tmp_path)
    sim, form = predicted(name, strategy, 1)
    assert sim == pytest.approx(measured, rel=1e-4)
    assert form == pytest.approx(measured, rel=0.15)


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.parametrize("name", WORKLOADS)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_gloo_ranks_prediction_equals_each_ranks_measured_peak(
    name: str, strategy: str
) -> None:
    sim, form = predicted(name, strategy, 2)
    # gloo drops a finished collective's buffers on its own thread, sometimes a moment after
    # the training thread made its next tensors: such a run counts the buffer at its peak on
    # that rank. The race only ever adds; a rank that did not lose it gives the exact peak.
    for _ in range(3):
        peaks = measured_peaks(name, strategy, 2)
        assert len(peaks) == 2
        if min(peaks) == pytest.approx(sim, rel=1e-4):
            break
    assert min(peaks) == pytest.approx(sim, rel=1e-4)
    assert max(peaks) <= sim * 1.2
    assert form == pytest.approx(min(peaks), rel=0.15)


FROZEN = """
import torch
from torch import nn
from gpukit.workloads import Workload


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    for layer in (model[0], model[2]):  # mostly frozen: the peak is in DDP's setup
        layer.requires_grad_(False)
    x = torch.randn(256, 64)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 10, (256,)))
    return Workload("frozen", model, data, nn.CrossEntropyLoss(), 32, 1e-3, 1, 0.0)
"""


@pytest.mark.processes
def test_a_mostly_frozen_model_under_ddp_peaks_in_ddp_setup_and_is_predicted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Trained as gpukit train runs, in a process of its own: in a test process that other
    # tests ran in first, the measured peak was sometimes 28,968 bytes higher.
    (tmp_path / "frozen_wl.py").write_text(FROZEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["train", "--workload", "frozen_wl:make", "--max-steps", str(STEPS), "--precision", "32"]
    argv += ["--strategy", "ddp", "--devices", "1", "--out", str(tmp_path / "o")]
    path = os.pathsep.join([str(tmp_path), str(SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run([sys.executable, "-m", "gpukit", *argv], env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()
    (row,) = json.loads((tmp_path / "o" / "metrics.json").read_text())["memory"]["devices"]
    import frozen_wl

    (sim,) = simulate(frozen_wl.make, strategy="ddp", devices=1, micro_batch=32)
    assert sim.peak_bytes == row["peak_tensors"]
