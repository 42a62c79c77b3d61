"""gpukit bench trace: the cost of gk.trace() on a training loop, measured and shown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.bench.trace_cost import run_trace_cost, table
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError


def test_a_short_run_has_both_variants_and_a_ratio() -> None:
    result = run_trace_cost(workload="mlp", steps=3, rounds=2)
    names = [v["name"] for v in result["variants"]]
    assert names == ["untraced", "traced"]
    assert all(len(v["rounds"]) == 2 and v["seconds_per_step"] > 0 for v in result["variants"])
    low, high = result["ratio_range"]
    assert low <= result["ratio"] <= high and result["environment"]["device"] == "cpu"
    assert table(result).row_count == 2


def test_cli_writes_the_json_it_prints(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "trace.json"
    args = ["bench", "trace", "--workload", "mlp", "--steps", "2", "--rounds", "1", "--json"]
    assert main([*args, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["experiment"] == "trace"


@pytest.mark.parametrize("bad", [{"steps": 0}, {"rounds": -1}, {"steps": True}])
def test_bad_counts_are_refused(bad: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match="whole number of at least 1"):
        run_trace_cost(workload="mlp", **bad)


def test_an_unknown_workload_fails_before_timing(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "trace", "--workload", "nosuch"]) == 2
    assert "nosuch" in capsys.readouterr().err
