"""gpukit bench multidevice: which comparisons run on which hardware, that every way of
computing C = Aⁿ + Bⁿ gives the same C, and the result's shape, table and plot. Only the
bookkeeping is checked, never the size of a timing."""

from __future__ import annotations

import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gpukit._util.text import render_plain
from gpukit.bench import multidevice as md
from gpukit.bench import powers
from gpukit.bench.result import BenchResult
from gpukit.errors import ConfigError

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.fixture
def quick(quick_multidevice: BenchResult) -> BenchResult:
    return quick_multidevice


def test_on_a_cpu_two_threads_are_compared_with_one(quick: BenchResult) -> None:
    assert {r["comparison"] for r in quick.rows} == {md.THREADS}
    setups = [r["setup"] for r in quick.rows]
    assert setups[:2] == ["in turn, 1 thread", "at once, 2 threads × 1"]
    assert setups[2] == f"in turn, {quick.parameters['threads']} threads (default)"
    keys = {c.key for c in quick.columns}
    for row in quick.rows:
        assert keys <= set(row)
        assert math.isfinite(row["ms"]) and row["ms"] > 0
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0
        assert row["matches"] is True and row["size"] == md.QUICK_SIZES["cpu"]
    base, *others = quick.rows
    assert base["speedup"] == 1.0 and base["ideal"] is None
    assert all(math.isfinite(r["ideal"]) and r["ideal"] >= 1.0 for r in others)


def test_the_result_keeps_raw_timings_summary_and_notes(quick: BenchResult) -> None:
    assert quick.experiment == "multidevice" and quick.keys == ("comparison", "setup")
    raw = quick.raw[md.THREADS]
    assert set(raw) == {r["setup"] for r in quick.rows}
    assert all(s["n"] >= 3 and len(s["raw"]) == s["n"] for s in raw.values())
    assert set(quick.summary) == {f"speed-up, {r['setup']}" for r in quick.rows[1:]}
    assert all(math.isfinite(v) and v > 0 for v in quick.summary.values())
    assert any("not two devices" in note for note in quick.notes)
    assert quick.parameters["power"] == powers.POWER == 10
    assert torch.get_num_threads() == quick.parameters["threads"]  # restored after the 1s
    again = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    assert again.rows == quick.rows
    text = render_plain(quick.table(), width=200)
    assert "at once, 2 threads × 1" in text and "speed-up (×)" in text


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([CPU], [md.THREADS]),
        ([GPU0], [md.STREAMS]),
        ([CPU, GPU0], [md.STREAMS, md.CPU_GPU]),
        ([GPU0, GPU1], [md.TWO_GPUS, md.PRODUCTS, md.STREAMS]),
        ([CPU, GPU0, GPU1], [md.TWO_GPUS, md.PRODUCTS, md.STREAMS, md.CPU_GPU]),
    ],
)
def test_the_comparisons_follow_the_hardware(
    devices: list[torch.device], expected: list[str]
) -> None:
    assert md.plan(devices) == expected


def test_every_way_of_computing_gives_the_same_c() -> None:
    gen = torch.Generator().manual_seed(1)
    a, b = (torch.randn(48, 48, generator=gen) / 48**0.5 for _ in range(2))
    reference = torch.linalg.matrix_power(a, 10) + torch.linalg.matrix_power(b, 10)
    assert torch.isfinite(reference).all()
    with ThreadPoolExecutor(2) as pool:
        results = [
            powers.one_after_the_other((a, b)),
            powers.sum_of_powers((a, b)),
            powers.in_two_threads((a, b), pool),
        ]
    assert all(powers.matches(c, reference) for c in results)


def test_two_threads_each_compute_with_one_intra_op_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[str, int]] = []
    power = powers.power

    def spy(m: torch.Tensor, n: int = powers.POWER) -> torch.Tensor:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return power(m, n)

    monkeypatch.setattr(powers, "power", spy)
    before = torch.get_num_threads()
    with ThreadPoolExecutor(2, thread_name_prefix="worker") as pool:
        powers.in_two_threads((torch.eye(4), torch.eye(4)), pool)
    assert len(seen) == 2 and all(name.startswith("worker") and n == 1 for name, n in seen)
    assert torch.get_num_threads() == before  # the caller's setting is untouched


def test_matches_tells_a_wrong_result_apart() -> None:
    c = torch.randn(8, 8)
    assert powers.matches(c, c + 1e-7) and powers.matches((c, c), (c, c))
    assert not powers.matches(c, c * 1.1)
    assert not powers.matches(c * float("nan"), c)
    assert not powers.matches(c[:4], c) and not powers.matches((c,), (c, c))


def test_the_plot_is_drawn_from_the_stored_result(quick: BenchResult, tmp_path: Path) -> None:
    stored = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    md.plot(stored, tmp_path / "multidevice.png")
    assert (tmp_path / "multidevice.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ([torch.device("cuda", 5)], "no device .cuda:5. here: this machine has cpu"),
        ([], "no devices given"),
    ],
)
def test_bad_devices_say_what_is_here(devices: list[torch.device], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        md.run(quick=True, devices=devices)


@pytest.mark.gpu
def test_on_one_gpu_two_streams_and_cpu_plus_gpu_give_the_same_c() -> None:
    result = md.run(quick=True, devices=[CPU, GPU0])
    assert [r["comparison"] for r in result.rows] == [md.STREAMS] * 2 + [md.CPU_GPU] * 2
    assert all(r["matches"] is True for r in result.rows)
    assert all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in result.rows)
    overlapped = result.rows[-1]
    assert 1.0 <= overlapped["ideal"] <= 2.0  # bounded by the slower of the two devices
    a, b = (torch.randn(256, 256, device=GPU0) / 16 for _ in range(2))
    streams = (torch.cuda.Stream(GPU0), torch.cuda.Stream(GPU0))
    two = powers.on_two_streams((a, b), streams)
    assert powers.matches(two, powers.sum_of_powers((a, b)))


@pytest.mark.multigpu
def test_on_two_gpus_every_setup_gives_the_same_c() -> None:
    result = md.run(quick=True, devices=[GPU0, GPU1])
    comparisons = [r["comparison"] for r in result.rows]
    assert comparisons == [md.TWO_GPUS] * 2 + [md.PRODUCTS] * 2 + [md.STREAMS] * 2
    assert all(r["matches"] is True for r in result.rows)
    assert all(math.isfinite(r["ms"]) and r["speedup"] > 0 for r in result.rows)
    assert [r["ideal"] for r in result.rows] == [None, 2.0, None, 2.0, None, 1.0]
