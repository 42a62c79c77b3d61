"""gpukit bench trace: the cost of gk.trace() on a training loop, measured and shown; the
nanoGPT-style loop it times, and what a trace finds in it."""

from __future__ import annotations

import importlib
import json
import linecache
from collections import Counter
from pathlib import Path

import pytest

from gpukit.bench.nanogpt_loop import NanoGPTConfig, nanogpt_loop
from gpukit.bench.trace_cost import check_workload, run_trace_cost, table
from gpukit.cli.__main__ import main
from gpukit.diagnostics.trace import trace
from gpukit.errors import ConfigError

nanogpt_loop_module = importlib.import_module("gpukit.bench.nanogpt_loop")


def test_a_short_run_has_the_variants_and_their_ratios() -> None:
    result = run_trace_cost(workload="mlp", steps=3, rounds=2)
    names = [v["name"] for v in result["variants"]]
    assert names == ["untraced", "traced", "gpukit trace"]
    assert all(len(v["rounds"]) == 2 and v["seconds_per_step"] > 0 for v in result["variants"])
    low, high = result["ratio_range"]
    assert low <= result["ratio"] <= high and result["environment"]["device"] == "cpu"
    low, high = result["cli_ratio_range"]
    assert low <= result["cli_ratio"] <= high
    assert table(result).row_count == 3


def test_cli_writes_the_json_it_prints(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "trace.json"
    args = ["bench", "trace", "--workload", "mlp", "--steps", "2", "--rounds", "1", "--json"]
    assert main([*args, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["experiment"] == "trace"
    assert [(r["workload"], r["variant"]) for r in printed["rows"]] == [
        ("mlp", "untraced"),
        ("mlp", "traced"),
        ("mlp", "gpukit trace"),
    ]
    assert set(printed["summary"]) == {"mlp: traced x untraced", "mlp: gpukit trace x untraced"}
    assert printed["raw"]["results"][0]["rounds"] == 1


@pytest.mark.parametrize("bad", [{"steps": 0}, {"rounds": -1}, {"steps": True}])
def test_bad_counts_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="whole number of at least 1"):
        run_trace_cost(workload="mlp", **bad)


def test_an_unknown_workload_fails_before_timing(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", "--workload", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err


TINY = NanoGPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=1)


def test_the_nanogpt_loop_in_a_quick_run() -> None:
    result = run_trace_cost(workload="nanogpt", steps=2, rounds=1, nanogpt=TINY)
    assert [v["name"] for v in result["variants"]] == ["untraced", "traced", "gpukit trace"]
    assert result["workload"] == "nanogpt" and result["loop"] == "nanoGPT-style script"
    assert all(v["seconds_per_step"] > 0 for v in result["variants"])
    assert table(result).row_count == 3


def test_a_trace_of_the_nanogpt_loop_finds_its_reads_at_its_own_lines() -> None:
    with nanogpt_loop(TINY, device="cpu") as loop:
        loop(1)
        with trace() as t:
            loop(12)  # logs at 0, 5, 10; evaluates at 0 and 10 (one batch of each split)
        assert len(loop.logged) == 2 + 2 + 3  # loop(1) logged twice, then 2 evals and 3 logs
    found: Counter[tuple[str, str]] = Counter()
    for s in t.syncs:
        assert s.file == nanogpt_loop_module.__file__ and not s.synchronised
        found[s.op, linecache.getline(s.file, s.line).strip()] += s.count
    # The memmap cut at torch.randint's offsets is host work, not a sync; the optimizer's
    # step counters are torch's own: what is left are the loop's own reads.
    items = {line: n for (op, line), n in found.items() if op == "item"}
    assert items == {
        "lossf = loss.item() * c.gradient_accumulation_steps": 3,
        "losses[k] = self.loss(*self.get_batch(split)).item()": 2 * 2,
    }
    prints = {line: n for (op, line), n in found.items() if op == "print"}
    assert sum(prints.values()) == 2 * 2  # the two estimates formatted, at each evaluation
    assert all("losses[" in line for line in prints)  # the lines of that f-string
    assert set(found) == {("item", line) for line in items} | {("print", p) for p in prints}
    report = t.report()
    assert "memmap.py" not in report and "Python index" not in report
    assert "rt.log" in report and "log less often" in report


def test_nanogpt_is_a_workload_of_the_bench_only(capsys) -> None:  # type: ignore[no-untyped-def]
    check_workload("nanogpt")  # the bench's own loop: no workload of gpukit train
    assert main(["trace", "--workload", "nanogpt"]) == 2
    assert "nanogpt" in capsys.readouterr().err
