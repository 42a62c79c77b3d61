"""The matmul experiment: its result's schema on the CPU, the sweep's stops (slow sizes, out of
memory) and headline figures with pretend timings, the TF32 flag's restore, and on a GPU the
physics that must hold. Never the size of a timing on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpukit._util.text import render_plain
from gpukit.bench import matmul
from gpukit.bench.measure import stats
from gpukit.bench.result import BenchResult
from gpukit.devices import hw as _hw
from gpukit.errors import ConfigError

CPU = torch.device("cpu")
STATS_KEYS = {"median", "low", "high", "q1", "q3", "n", "raw"}


@pytest.fixture
def quick_cpu(quick_matmul: BenchResult) -> BenchResult:
    return quick_matmul


def test_sizes_are_powers_of_two_from_16_to_8192() -> None:
    assert matmul.SIZES[0] == 16 and matmul.SIZES[-1] == 8192
    assert all(b == 2 * a for a, b in zip(matmul.SIZES, matmul.SIZES[1:], strict=False))
    assert set(matmul.QUICK_SIZES) < set(matmul.SIZES)


def test_quick_cpu_run_has_one_row_per_size_with_its_raw_timings(quick_cpu: BenchResult) -> None:
    r = quick_cpu
    assert r.experiment == "matmul" and r.keys == ("device", "dtype", "n")
    assert set(r.keys) <= {c.key for c in r.columns}
    assert [c.key for c in r.columns][:6] == ["device", "dtype", "n", "ms", "tflops", "peak_pct"]
    assert [(row["device"], row["dtype"], row["n"]) for row in r.rows] == [
        ("cpu", "fp32", n) for n in matmul.QUICK_SIZES
    ]
    for row in r.rows:
        assert row["ms"] > 0 and row["tflops"] > 0
        assert row["tflops"] == pytest.approx(2 * row["n"] ** 3 / (row["ms"] / 1e3) / 1e12)
        assert row["peak_pct"] is None  # a CPU's peak is not known
        assert "ms_with_copies" not in row  # the copies are a GPU's
    raw = r.raw["stats"]
    assert [(s["n"], s["variant"]) for s in raw] == [(n, "on device") for n in matmul.QUICK_SIZES]
    for entry, row in zip(raw, r.rows, strict=True):
        assert set(entry["stats"]) == STATS_KEYS
        assert entry["stats"]["n"] >= matmul.QUICK["min_repeats"]
        assert entry["stats"]["median"] * 1e3 == pytest.approx(row["ms"])


def test_quick_cpu_run_carries_parameters_environment_summary_and_notes(
    quick_cpu: BenchResult,
) -> None:
    r = quick_cpu
    assert r.parameters["quick"] is True and r.parameters["sizes"] == list(matmul.QUICK_SIZES)
    assert r.parameters["dtypes"] == {"cpu": ["fp32"]}
    assert [d["device"] for d in r.environment["devices"]] == ["cpu"]
    assert set(r.summary) == {"cpu fp32 best TFLOP/s"}
    assert r.summary["cpu fp32 best TFLOP/s"] == max(row["tflops"] for row in r.rows)
    assert any("'-' on the CPU" in note for note in r.notes)
    assert BenchResult.from_dict(json.loads(json.dumps(r.to_dict()))).rows == r.rows
    assert "cpu fp32 best TFLOP/s" in render_plain(r.table())


def test_plot_draws_a_png_from_the_stored_result(quick_cpu: BenchResult, tmp_path: Path) -> None:
    stored = BenchResult.from_dict(json.loads(json.dumps(quick_cpu.to_dict())))
    matmul.plot(stored, tmp_path / "matmul.png")
    assert (tmp_path / "matmul.png").stat().st_size > 1000


def test_a_sweep_stops_before_a_product_slower_than_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 1 ns per multiply-add: n=1024 takes ~1.1 s, so n=2048 would take ~8.6 s > CAP_S.
    monkeypatch.setattr(matmul, "_time_product", lambda dev, dtype, n, t, w: stats([n**3 * 1e-9]))
    r = matmul.run(devices=[CPU])
    assert [row["n"] for row in r.rows] == list(matmul.SIZES)  # skipped sizes are still rows
    measured = [row["n"] for row in r.rows if "ms" in row]
    assert measured == [n for n in matmul.SIZES if n <= 1024]
    skipped = [row for row in r.rows if row["n"] > 1024]
    assert all(row["note"].startswith("skipped: one product would take ~9 s") for row in skipped)
    assert any("n >= 2048 skipped" in note for note in r.notes)
    assert len(r.raw["stats"]) == len(measured)


def test_a_sweep_stops_at_the_first_size_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def product(dev: torch.device, dtype: str, n: int, t: object, w: int) -> object:
        if n >= 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return stats([1e-6])

    monkeypatch.setattr(matmul, "_time_product", product)
    r = matmul.run(quick=True, devices=[CPU])
    assert [row.get("note") for row in r.rows if row["n"] >= 256] == [
        "skipped: out of memory from n=256"
    ] * len([n for n in matmul.QUICK_SIZES if n >= 256])
    assert any("ran out of memory" in note for note in r.notes)


def test_summary_finds_where_a_gpu_overtakes_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matmul, "device_name", lambda d: "cpu" if d.type == "cpu" else "gpu")
    cpu = [
        {"device": "cpu", "dtype": "fp32", "n": n, "ms": ms, "tflops": 1.0}
        for n, ms in ((16, 0.01), (32, 0.05), (64, 0.4), (128, 3.0))
    ]
    gpu = [
        {"device": "gpu", "dtype": "fp32", "n": n, "ms": ms, "ms_with_copies": c, "tflops": t}
        for n, ms, c, t in (
            (16, 0.02, 0.1, 5.0),
            (32, 0.02, 0.2, 9.0),
            (64, 0.03, 0.3, 7.0),
            (128, 0.05, 0.5, 8.0),
        )
    ]
    gpu.append({"device": "gpu", "dtype": "bf16", "n": 128, "ms": 0.01, "tflops": 40.0})
    summary = matmul.summarise(cpu + gpu, [CPU, torch.device("cuda", 0)])
    assert summary["cuda:0 fp32 faster than cpu from n"] == 32
    assert summary["cuda:0 fp32 with copies faster than cpu from n"] == 64
    assert summary["cuda:0 fp32 best TFLOP/s"] == 9.0
    assert summary["cuda:0 bf16 best TFLOP/s"] == 40.0
    assert summary["cpu fp32 best TFLOP/s"] == 1.0


def test_crossover_needs_the_gpu_faster_at_every_larger_size() -> None:
    cpu = {16: 1.0, 32: 1.0, 64: 1.0, 128: 1.0}
    assert matmul.crossover(cpu, {16: 2.0, 32: 0.5, 64: 2.0, 128: 0.5}) == 128
    assert matmul.crossover(cpu, {16: 0.5, 32: 0.5, 64: 0.5, 128: 2.0}) is None
    assert matmul.crossover(cpu, {16: 0.5, 32: None, 64: 0.5}) == 16  # unmeasured: ignored
    assert matmul.crossover({}, {16: 0.5}) is None


def test_gpus_before_ampere_are_measured_without_tf32_and_bf16(fake_gpus) -> None:  # type: ignore[no-untyped-def]
    fake = fake_gpus(2)
    fake.props[1] = _hw.CudaProperties("Tesla V100-SXM2-16GB", 16 << 30, (7, 0), "GPU-1")
    notes: list[str] = []
    assert matmul.dtypes_of(torch.device("cuda", 0), notes) == ["fp32", "tf32", "bf16", "fp16"]
    assert notes == []
    assert matmul.dtypes_of(torch.device("cuda", 1), notes) == ["fp32", "fp16"]
    assert notes == [
        "cuda:1 (Tesla V100-SXM2-16GB): tf32 and bf16 not measured: their tensor cores need "
        "compute capability 8.0 (Ampere) or later, this GPU has 7.0"
    ]


TF32_STATES = r"""
import os, sys, traceback
import torch
from gpukit.bench import matmul

m = torch.backends.cuda.matmul


def state():
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "unreadable"
    return (m.allow_tf32, m.fp32_precision, legacy, torch.backends.fp32_precision,
            torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)


SETUPS = [
    "pass",
    "m.allow_tf32 = True",
    "m.allow_tf32 = False",
    "torch.set_float32_matmul_precision('high')",
    "torch.set_float32_matmul_precision('medium')",
    "torch.set_float32_matmul_precision('high'); m.allow_tf32 = False",
]
for setup in SETUPS:
    pid = os.fork()
    if pid == 0:  # a fresh copy of the process's settings for each setup
        try:
            exec(setup)
            start = state()
            for enabled in (True, False):
                with matmul._tf32(torch.device("cuda", 0), enabled):
                    assert m.allow_tf32 is enabled
                assert state() == start, (setup, start, state())
            try:
                with matmul._tf32(torch.device("cuda", 0), True):
                    raise KeyError("a failed product")
            except KeyError:
                pass
            assert state() == start, (setup, "after an error", state())
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        sys.exit(f"not restored after: {setup}")
"""


@pytest.mark.processes
@pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
    reason="needs fork and torch's fp32_precision settings (torch 2.9+)",
)
def test_tf32_is_set_only_inside_the_block_and_every_setting_restored_after() -> None:
    # A process of its own: these settings are global, and some cannot be reset in place.
    done = subprocess.run([sys.executable, "-c", TF32_STATES], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_tf32_is_left_alone_on_the_cpu() -> None:
    before = torch.backends.cuda.matmul.allow_tf32
    with matmul._tf32(CPU, not before):
        assert torch.backends.cuda.matmul.allow_tf32 == before


def test_unknown_or_missing_devices_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"no device 'gpu:7' here: this machine has cpu"):
        matmul.run(quick=True, devices=["gpu:7"])  # type: ignore[list-item]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"no device 'cuda:0' here"):
            matmul.run(quick=True, devices=[torch.device("cuda", 0)])
    with pytest.raises(ConfigError, match="no devices given"):
        matmul.run(quick=True, devices=[])
    assert matmul.check_devices(["cpu", CPU, "cpu:0"], "matmul") == [CPU]


@pytest.mark.gpu
def test_gpu_quick_run_obeys_the_physics() -> None:
    flag = torch.backends.cuda.matmul.allow_tf32
    gpu = torch.device("cuda", 0)
    r = matmul.run(quick=True, devices=[CPU, gpu])
    assert torch.backends.cuda.matmul.allow_tf32 == flag  # restored
    name = matmul.device_name(gpu)
    dtypes = r.parameters["dtypes"]["cuda:0"]
    rows = {(row["dtype"], row["n"]): row for row in r.rows if row["device"] == name}
    assert set(rows) == {(d, n) for d in dtypes for n in matmul.QUICK_SIZES}
    largest = matmul.QUICK_SIZES[-1]
    fp32 = rows["fp32", largest]
    assert fp32["ms_with_copies"] > fp32["ms"]  # the copies only add time
    if "bf16" in dtypes:
        assert rows["bf16", largest]["ms"] < fp32["ms"]
    shares = [row["peak_pct"] for row in rows.values() if row.get("peak_pct") is not None]
    assert all(0 < share < 110 for share in shares), shares
    assert "cuda:0 fp32 faster than cpu from n" in r.summary
