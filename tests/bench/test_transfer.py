"""The transfer experiment: its CPU result's schema, what it keeps for gk.trace (and that a
store it cannot write costs only a note), its headline figures, and on a GPU the physics that
must hold. Never the size of a timing on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpukit.bench import transfer, transfer_table
from gpukit.bench.result import BenchResult
from gpukit.devices import measured
from gpukit.errors import ConfigError

CPU = torch.device("cpu")
STATS_KEYS = {"median", "low", "high", "q1", "q3", "n", "raw"}
FIGURES = {
    "h2d_pageable_bps": 10e9,
    "h2d_pinned_bps": 25e9,
    "d2h_pageable_bps": 8e9,
    "d2h_pinned_bps": 24e9,
    "d2d_local_bps": 1.2e12,
    "h2d_latency_s": 8e-6,
    "d2h_latency_s": 12e-6,
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def quick_cpu(quick_transfer: BenchResult) -> BenchResult:
    return quick_transfer


def test_sizes_run_from_4_kib_to_1_gib_by_fours() -> None:
    assert transfer.SIZES[0] == 4096 and transfer.SIZES[-1] == 1024**3
    assert all(b == 4 * a for a, b in zip(transfer.SIZES, transfer.SIZES[1:], strict=False))
    assert transfer.SIZES[: len(transfer.QUICK_SIZES)] == transfer.QUICK_SIZES


def test_quick_cpu_run_copies_host_memory_at_every_size(quick_cpu: BenchResult) -> None:
    r = quick_cpu
    assert r.experiment == "transfer" and r.keys == transfer.KEYS
    assert set(r.keys) <= {c.key for c in r.columns}  # compare matches rows on shown columns
    assert {c.key for c in r.columns} >= {"device", "test", "memory", "size", "us", "gbps"}
    copies = [row for row in r.rows if row["test"] == "h2h"]
    assert [row["bytes"] for row in copies] == list(transfer.QUICK_SIZES)
    for row in copies:
        assert row["device"] == "cpu" and row["memory"] == "pageable"
        assert row["gbps"] == pytest.approx(row["bytes"] / (row["us"] / 1e6) / 1e9)
        assert row["pcie_pct"] is None  # no link between host and host
    (tiny,) = [row for row in r.rows if row["test"] == "h2h latency"]
    assert tiny["bytes"] == 4 and tiny["us"] > 0 and "gbps" not in tiny
    assert len(r.rows) == len(transfer.QUICK_SIZES) + 1
    assert not any(row["test"] in ("h2d", "d2h", "d2d", "overlap") for row in r.rows)


def test_quick_cpu_run_keeps_raw_timings_summary_and_says_a_gpu_is_needed(
    quick_cpu: BenchResult,
) -> None:
    r = quick_cpu
    raw = r.raw["stats"]
    assert [{k: e[k] for k in transfer.KEYS} for e in raw] == [
        {k: row[k] for k in transfer.KEYS} for row in r.rows
    ]
    assert all(set(e["stats"]) == STATS_KEYS and e["stats"]["n"] >= 3 for e in raw)
    assert [e["bytes"] for e in raw] == [row["bytes"] for row in r.rows]
    assert set(r.summary) == {"cpu h2h best GB/s", "cpu h2h latency µs"}
    best = max(row["gbps"] for row in r.rows if "gbps" in row)
    assert r.summary["cpu h2h best GB/s"] == pytest.approx(best)
    assert any("host<->device rows need one" in note for note in r.notes)
    assert r.parameters["quick"] is True and r.parameters["remember"] is True
    assert [d["device"] for d in r.environment["devices"]] == ["cpu"]
    assert BenchResult.from_dict(json.loads(json.dumps(r.to_dict()))).rows == r.rows


def test_plot_draws_a_png_from_the_stored_result(quick_cpu: BenchResult, tmp_path: Path) -> None:
    stored = BenchResult.from_dict(json.loads(json.dumps(quick_cpu.to_dict())))
    transfer.plot(stored, tmp_path / "transfer.png")
    assert (tmp_path / "transfer.png").stat().st_size > 1000


def test_a_cpu_only_run_keeps_nothing_for_the_trace(
    quick_cpu: BenchResult, quick_transfer_cache: Path
) -> None:
    assert quick_cpu.parameters["remember"] is True  # it would have kept a GPU's figures
    assert not quick_transfer_cache.exists()


def test_a_gpus_figures_are_kept_for_the_trace(cache: Path) -> None:
    r = BenchResult("transfer", "t", (), ())
    transfer._remember(r, "NVIDIA H100 80GB HBM3", FIGURES, quick=False)
    kept = measured.load("NVIDIA H100 80GB HBM3")
    assert kept is not None and kept["figures"] == FIGURES and kept["quick"] is False
    assert r.notes == [
        f"NVIDIA H100 80GB HBM3: figures kept in {measured.path()} for gk.trace's cost estimates"
    ]


def test_a_quick_run_does_not_replace_a_full_runs_figures(cache: Path) -> None:
    measured.save("NVIDIA H100 80GB HBM3", FIGURES, quick=False)
    r = BenchResult("transfer", "t", (), ())
    transfer._remember(r, "NVIDIA H100 80GB HBM3", {"h2d_pinned_bps": 1.0}, quick=True)
    kept = measured.load("NVIDIA H100 80GB HBM3")
    assert kept is not None and kept["figures"] == FIGURES
    assert "a quick run does not replace them" in r.notes[0]
    transfer._remember(r, "NVIDIA H100 80GB HBM3", {"h2d_pinned_bps": 1.0}, quick=False)
    kept = measured.load("NVIDIA H100 80GB HBM3")
    assert kept is not None and kept["figures"] == {"h2d_pinned_bps": 1.0}


def test_a_store_that_cannot_be_written_costs_a_note_not_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GPUKIT_CACHE_DIR", str(blocker / "cache"))
    r = BenchResult("transfer", "t", (), ())
    transfer._remember(r, "NVIDIA H100 80GB HBM3", FIGURES, quick=False)
    assert "could not keep these figures for gk.trace" in r.notes[0]
    assert "nothing here is lost" in r.notes[0]


def test_summary_of_a_gpu_has_ratios_shares_and_latencies() -> None:
    r = BenchResult("transfer", "t", (), ())
    transfer_table.summarise(r, "cuda:0", FIGURES, peak=31.5e9, gain=1.8)
    s = r.summary
    assert s["cuda:0 h2d pinned best GB/s"] == 25.0 and s["cuda:0 h2d pageable best GB/s"] == 10.0
    assert s["cuda:0 h2d pinned/pageable ×"] == pytest.approx(2.5)
    assert s["cuda:0 d2h pinned/pageable ×"] == pytest.approx(3.0)
    assert s["cuda:0 h2d pinned % of PCIe peak"] == pytest.approx(100 * 25 / 31.5)
    assert s["cuda:0 PCIe peak GB/s"] == 31.5 and s["cuda:0 d2d local best GB/s"] == 1200.0
    assert s["cuda:0 h2d latency µs"] == pytest.approx(8.0)
    assert s["cuda:0 d2h latency µs"] == pytest.approx(12.0)
    assert s["cuda:0 overlap gain ×"] == 1.8
    unknown = BenchResult("transfer", "t", (), ())
    transfer_table.summarise(unknown, "cuda:0", FIGURES, peak=None, gain=None)
    assert unknown.summary["cuda:0 PCIe peak GB/s"] is None
    assert "cuda:0 h2d pinned % of PCIe peak" not in unknown.summary


def test_unknown_devices_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"transfer: no device 'cuda:9' here"):
        transfer.run(quick=True, devices=[torch.device("cuda", 9)], remember=False)


@pytest.mark.gpu
def test_gpu_quick_run_obeys_the_physics(cache: Path) -> None:
    gpu = torch.device("cuda", 0)
    r = transfer.run(quick=True, devices=[gpu])
    name = transfer.device_name(gpu)
    rows = [row for row in r.rows if row["device"] == name]
    largest = transfer.QUICK_SIZES[-1]

    def at(test: str, memory: str, size: int = largest) -> dict:
        (row,) = [x for x in rows if (x["test"], x["memory"], x["bytes"]) == (test, memory, size)]
        return row

    assert at("h2d", "pinned")["gbps"] > at("h2d", "pageable")["gbps"]
    assert at("d2h", "pinned")["gbps"] > at("d2h", "pageable")["gbps"]
    shares = [row["pcie_pct"] for row in rows if row.get("pcie_pct") is not None]
    assert all(0 < share < 110 for share in shares), shares
    assert at("h2d latency", "pageable", 4)["us"] > 0 and at("d2h latency", "pageable", 4)["us"] > 0
    overlap = [row for row in rows if row["test"] == "overlap"]
    assert [row["mode"] for row in overlap][1:] == [
        "copy alone",
        "copy, then matmul",
        "copy ∥ matmul",
    ]
    assert r.summary["cuda:0 overlap gain ×"] > 0
    kept = measured.load(torch.cuda.get_device_name(0))
    assert kept is not None and kept["quick"] is True
    assert kept["figures"]["h2d_pinned_bps"] == pytest.approx(
        r.summary["cuda:0 h2d pinned best GB/s"] * 1e9
    )
