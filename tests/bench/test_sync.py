"""gpukit bench sync: the read-backs of every variant, as gk.trace() counts them, and the
result's shape, table and plot. Only the bookkeeping is checked, never the size of a timing
(but on a GPU, that reading back every step is slower than once)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gpukit as gk
from gpukit._util.text import render_plain
from gpukit.bench import sync
from gpukit.bench.result import BenchResult
from gpukit.bench.timing import torch_threads
from gpukit.errors import ConfigError

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The loops called directly run as run() runs them on the CPU: with one thread."""
    with torch_threads(sync.CPU_THREADS):
        yield


@pytest.fixture
def quick(quick_sync: BenchResult) -> BenchResult:
    return quick_sync


def test_a_quick_run_has_every_variant_and_its_syncs(quick: BenchResult) -> None:
    steps = quick.parameters["steps"]
    assert steps == sync.QUICK_STEPS == 200
    assert [(r["device"], r["variant"]) for r in quick.rows] == [("cpu", v) for v in sync.VARIANTS]
    syncs = {r["variant"]: r["syncs"] for r in quick.rows}
    assert syncs == {"device-log": 1, "item-every-10": 20, "item": 200, "print": 201}
    keys = {c.key for c in quick.columns}
    for row in quick.rows:
        assert keys <= set(row)
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("loop_ms", "step_us", "ratio"))
        assert row["step_us"] == pytest.approx(row["loop_ms"] * 1e3 / steps)
    base, *others = quick.rows
    assert base["ratio"] == 1.0 and base["sync_us"] is None
    assert all(math.isfinite(r["sync_us"]) for r in others)


def test_the_result_keeps_raw_timings_summary_and_environment(quick: BenchResult) -> None:
    assert quick.experiment == "sync" and quick.keys == ("device", "variant")
    for variant in sync.VARIANTS:
        raw = quick.raw["cpu"][variant]
        assert raw["n"] >= 3 and len(raw["raw"]) == raw["n"]
    assert set(quick.summary) == {"cpu: item / device-log", "cpu: cost per sync (µs)"}
    assert all(math.isfinite(v) for v in quick.summary.values())
    assert [d["device"] for d in quick.environment["devices"]] == ["cpu"]
    assert any("the lesson" in note for note in quick.notes)
    again = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    assert again.rows == quick.rows and again.summary == quick.summary


def test_the_table_shows_every_variant(quick: BenchResult) -> None:
    text = render_plain(quick.table(), width=200)
    assert all(v in text for v in sync.VARIANTS) and "cost per sync (µs)" in text


@pytest.mark.parametrize(
    ("variant", "expected"),
    [
        ("device-log", {"item": 1}),
        ("item-every-10", {"item": 3}),  # steps 10 and 20, then the last one, 25
        ("item", {"item": 25}),
        ("print", {"print": 25, "item": 1}),
    ],
)
def test_the_tracer_counts_the_read_backs_of_each_variant(
    variant: str, expected: dict[str, int]
) -> None:
    starts, w = sync.inputs(CPU)
    with gk.trace() as t:
        sync.loop(variant, starts[0], w, steps=25)
    counts: Counter[str] = Counter()
    for s in t.syncs:
        counts[s.op] += s.count
    assert dict(counts) == expected
    assert sum(counts.values()) == sync.syncs_per_loop(variant, 25)
    assert not any(s.synchronised for s in t.syncs)  # on the CPU: potential syncs only
    assert t.transfers == []


def test_every_variant_computes_the_same_sum(capsys: pytest.CaptureFixture[str]) -> None:
    starts, w = sync.inputs(CPU)
    sums = [sync.loop(v, starts[1], w, steps=50) for v in sync.VARIANTS]
    assert all(math.isfinite(s) for s in sums)
    assert sums == pytest.approx([sums[0]] * len(sums), rel=1e-5)
    assert capsys.readouterr().out == ""  # print writes into memory, not to the terminal


def test_the_plot_is_drawn_from_the_stored_result(quick: BenchResult, tmp_path: Path) -> None:
    stored = BenchResult.from_dict(json.loads(json.dumps(quick.to_dict())))
    sync.plot(stored, tmp_path / "sync.png")
    assert (tmp_path / "sync.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: sync.loop("items", torch.eye(2), torch.eye(2)), "variant 'items'.*device-log"),
        (lambda: sync.loop("item", torch.eye(2), torch.eye(2), steps=0), "steps=0"),
        (lambda: sync.syncs_per_loop("print", -1), "steps=-1"),
        (
            lambda: sync.run(devices=[torch.device("cuda", 7)]),
            "no device .cuda:7. here: this machine has cpu",
        ),
        (lambda: sync.run(devices=["tpu"]), "no device .tpu. here"),
        (lambda: sync.run(devices=[]), "no devices given"),
        (lambda: sync.run(devices="cpu"), "give a list of devices"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_says_what_is_allowed(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        call()


@pytest.mark.gpu
def test_on_a_gpu_reading_back_every_step_stalls_the_queue() -> None:
    result = sync.run(quick=True, devices=[torch.device("cuda", 0)])
    rows = {r["variant"]: r for r in result.rows}
    assert rows["item"]["ratio"] > 1.0 and rows["item"]["sync_us"] > 0
    assert all(math.isfinite(r["loop_ms"]) for r in result.rows)
    assert result.summary["cuda:0: item / device-log"] > 1.0


@pytest.mark.gpu
def test_on_a_gpu_the_tracer_sees_real_syncs() -> None:
    starts, w = sync.inputs(torch.device("cuda", 0))
    with gk.trace() as t:
        sync.loop("item", starts[0], w, steps=10)
    assert [(s.op, s.count, s.synchronised) for s in t.syncs] == [("item", 10, True)]
