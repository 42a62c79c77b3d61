"""The trace report's cost model: the figures ``gpukit bench transfer`` kept for the GPU the
trace saw change the ranking and the header; without them, the rough defaults, said so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpukit.devices import hw as _hw
from gpukit.devices import measured
from gpukit.diagnostics.trace import Sync, Transfer
from gpukit.diagnostics.trace.report import CostModel, cost_model, render

H100 = "NVIDIA H100 80GB HBM3"
# 4 KiB copied once from pageable memory, and one .item(): with the rough defaults the sync
# (30 us) outranks the copy (10 us + 4 KiB at 12 GB/s); on a machine whose pageable copies
# are slow and whose round trips are quick, the copy does.
COPY = Transfer("h2d", 4096, 1, __file__, 1, "step", False, True, "cpu", "cuda:0")
ITEM = Sync("item", 1, __file__, 2, "step", "cuda:0", True)
SLOW_COPIES = {"h2d_pageable_bps": 1e8, "h2d_latency_s": 20e-6, "d2h_latency_s": 5e-6}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path))
    return tmp_path


def ranked(report: str) -> list[str]:
    """The findings' kinds in report order: 'h2d' or '.item()'."""
    lines = [line for line in report.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    return [line.split("  ", 1)[1].split()[0] for line in lines]


def test_without_measured_figures_the_rough_defaults_rank_and_say_so(
    cache: Path,
    fake_gpus,  # type: ignore[no-untyped-def]
) -> None:
    fake_gpus(1)
    report = render({"cuda:0": 10}, [COPY], [ITEM])
    header = report.splitlines()[1]
    assert header.startswith("ranked by estimated cost on a GPU, from rough defaults (30 us")
    assert "`gpukit bench transfer` measures this machine's" in header
    assert ranked(report) == [".item()", "h2d"]


def test_figures_measured_for_the_traced_gpu_change_the_ranking_and_the_header(
    cache: Path,
    fake_gpus,  # type: ignore[no-untyped-def]
) -> None:
    fake_gpus(1)
    measured.save(H100, SLOW_COPIES)
    date = measured.load(H100)["date"][:10]  # type: ignore[index]
    report = render({"cuda:0": 10}, [COPY], [ITEM])
    header = report.splitlines()[1]
    assert f"figures of {H100} measured on this machine {date}" in header
    assert "(5 us per sync; copies 20 us + 0.1 GB/s pageable, 25 GB/s pinned)" in header
    assert ranked(report) == ["h2d", ".item()"]
    assert "~61 us  h2d 4 KiB once" in report  # 20 us + 4096 B at 0.1 GB/s


def test_the_gpu_the_trace_saw_is_the_one_whose_figures_count(
    cache: Path,
    fake_gpus,  # type: ignore[no-untyped-def]
) -> None:
    fake = fake_gpus(2)
    fake.props[1] = _hw.CudaProperties("NVIDIA A100-SXM4-80GB", 80 << 30, (8, 0), "GPU-1")
    measured.save("NVIDIA A100-SXM4-80GB", {"d2h_latency_s": 1e-6})
    on_1 = cost_model({"cpu": 3, "cuda:1": 10}, [])
    assert on_1.gpu == "NVIDIA A100-SXM4-80GB" and on_1.sync_s == 1e-6
    assert on_1.copy_launch_s == CostModel().copy_launch_s  # not measured: the default stays
    assert not cost_model({"cuda:0": 10}, []).measured  # nothing kept for the H100
    seen_in_a_copy = Transfer("d2h", 4, 1, __file__, 1, "f", False, True, "cuda:1", "cpu")
    assert cost_model({"cpu": 3}, [seen_in_a_copy]).gpu == "NVIDIA A100-SXM4-80GB"


def test_a_trace_that_saw_no_gpu_uses_the_first_one_present_once_cuda_runs(
    cache: Path,
    fake_gpus,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpus(2)
    measured.save(H100, SLOW_COPIES)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert cost_model({"cpu": 5}, []) == CostModel()  # the report does not start CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert cost_model({"cpu": 5}, []).gpu == H100


def test_no_gpu_or_a_broken_one_falls_back_to_the_defaults(
    cache: Path,
    fake_gpus,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured.save(H100, SLOW_COPIES)
    monkeypatch.setattr(_hw, "cuda_count", lambda: 0)
    assert cost_model({"cuda:0": 1}, []) == CostModel()
    fake = fake_gpus(1)
    fake.broken[0] = "CUDA error: uncorrectable ECC error encountered"
    assert cost_model({"cuda:0": 1}, []) == CostModel()
    assert "rough defaults" in render({"cuda:0": 1}, [COPY], [])


def test_measured_rates_follow_the_direction_and_the_memory() -> None:
    model = CostModel(d2h_pinned_bps=7e9, d2h_pageable_bps=3e9, peer_bps=9e9)
    assert model.rate("d2h", pinned=True) == 7e9 and model.rate("d2h", pinned=False) == 3e9
    assert model.rate("h2d", pinned=False) == CostModel().h2d_pageable_bps
    assert model.rate("d2d", pinned=False) == 9e9
