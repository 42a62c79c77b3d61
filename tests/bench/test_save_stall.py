"""gpukit bench save: both kinds of save are timed on the same model in the same run, the
ratio is the one the raw timings give, and bad input is refused. Only the bookkeeping is
checked, never the size of a timing."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from gpukit._util.text import render_plain
from gpukit.bench import save_stall, suite
from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError

CPU = torch.device("cpu")


def test_a_quick_run_times_both_saves_and_their_ratio(tmp_path: Path) -> None:
    result = save_stall.run(quick=True, devices=[CPU], rounds=2)
    assert [(r["device"], r["strategy"], r["mode"]) for r in result.rows] == [
        ("cpu", "single", "sync"),
        ("cpu", "single", "async"),
        ("cpu", "fsdp", "sync"),
        ("cpu", "fsdp", "async"),
    ]
    for label, (sync, background) in [
        ("cpu", result.rows[:2]),
        ("cpu fsdp", result.rows[2:]),
    ]:
        raw = result.raw[label]
        assert len(raw["stall_s"]["sync"]) == len(raw["stall_s"]["async"]) == 2
        assert all(s > 0 for mode in save_stall.MODES for s in raw["stall_s"][mode])
        ratios = [
            a / s for a, s in zip(raw["stall_s"]["async"], raw["stall_s"]["sync"], strict=True)
        ]
        assert background["stall_ratio"] == statistics.median(ratios)
        assert sync["stall_ratio"] == 1.0
        assert sync["mib"] == background["mib"] > 0
        # The background write is timed until published: never before its own call returned.
        assert all(
            w >= s for w, s in zip(raw["write_s"]["async"], raw["stall_s"]["async"], strict=True)
        )
        goal = result.summary[f"{label}: goal met (<= {save_stall.GOAL})"]
        assert goal == (background["stall_ratio"] <= save_stall.GOAL)
    # The sharded checkpoint holds the shards and the exported full weights beside them.
    assert result.rows[2]["mib"] > result.rows[0]["mib"]
    assert result.parameters["width"] == save_stall.QUICK_WIDTH
    assert "stall / sync save" in render_plain(result.table())
    save_stall.plot(result, tmp_path / "save.png")
    assert (tmp_path / "save.png").stat().st_size > 0
    assert suite.experiment("save") is save_stall


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rounds": 0}, "rounds=0"),
        ({"devices": ["tpu:0"]}, "save: no device 'tpu:0' here"),
    ],
)
def test_bad_input_is_refused_before_any_save(kwargs: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=message):
        save_stall.run(quick=True, **kwargs)


def test_the_command_refuses_zero_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "save", "--rounds", "0"]) == 2
    assert "--rounds 0: give a whole number of at least 1" in capsys.readouterr().err
