"""``gk.Runtime(parallel=...)`` and gpukit train's mesh flags (``--tp 2 --pp 2``): the one-mesh
strategy they make, and each bad input refused before any process starts."""

from __future__ import annotations

import pytest

import gpukit as gk
from gpukit.cli.__main__ import build_parser, main
from gpukit.cli._parallel_flags import parallel_setting as _parallel
from gpukit.cli.train import _worker_command
from gpukit.errors import ConfigError


def test_a_mapping_of_sizes_trains_on_one_mesh() -> None:
    rt = gk.Runtime(parallel={"dp_shard": 2, "tp": 2}, devices=["cpu"] * 4)
    assert rt.strategy.name == "parallel"
    assert rt.strategy.layout.described() == "dp_shard 2 x tp 2"
    assert rt.strategy.options.tp == 2 and rt.strategy.options.dp_shard == 2
    assert rt.strategy.sampler_placement() == (2, 0)  # the tp pair reads the same samples


def test_dp_shard_takes_what_the_other_sizes_leave() -> None:
    rt = gk.Runtime(parallel={"dp_replicate": 2}, devices=["cpu"] * 4)
    assert rt.strategy.layout.described() == "dp_replicate 2 x dp_shard 2"


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"parallel": 2}, "parallel=2: give a dict of dimension sizes"),
        ({"parallel": "tp2"}, "parallel='tp2'"),
        ({"parallel": {"tq": 2}}, "unknown key(s) 'tq'"),
        ({"parallel": {"tp": "2"}}, "parallel tp='2': give a whole number"),
        ({"parallel": {"tp": 2}, "strategy": "ddp"}, "drop strategy="),
        ({"parallel": {"tp": 3}, "devices": ["cpu"] * 4}, "multiply to 3, which does not divide 4"),
        (
            {"parallel": {"layout": "auto", "tp": 2}, "devices": ["cpu"] * 4},
            "'auto' chooses every size",
        ),
    ],
)
def test_a_bad_parallel_setting_is_one_clear_error(kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        gk.Runtime(**kwargs)  # type: ignore[arg-type]
    assert said in str(caught.value)


def test_the_mesh_flags_make_the_parallel_setting_with_fsdps_own() -> None:
    args = build_parser().parse_args(
        ["train", "--tp", "2", "--pp", "2", "--activation-checkpointing", "full"]
    )
    assert _parallel(args) == {"tp": 2, "pp": 2, "activation_checkpointing": "full"}
    assert _parallel(build_parser().parse_args(["train"])) is None
    assert _parallel(build_parser().parse_args(["train", "--strategy", "parallel"])) == {}


def test_each_rank_is_told_the_mesh_again() -> None:
    args = build_parser().parse_args(["train", "--devices", "4", "--tp", "2", "--cp", "2"])
    command = _worker_command(args, "parallel")
    at = command.index("--strategy")
    assert command[at + 1] == "parallel"
    assert command[command.index("--tp") + 1] == "2" and command[command.index("--cp") + 1] == "2"


def test_mesh_flags_with_another_strategy_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--max-steps", "1", "--strategy", "ddp", "--tp", "2"]) == 2
    said = capsys.readouterr().err
    assert "--tp 2 trains on one mesh" in said and "drop --strategy" in said


def test_a_layout_the_model_cannot_take_is_refused_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # gpt has 4 heads: 8 tensor-parallel ranks cannot split them. Said by the command itself,
    # from the model built on the meta device, not by 8 ranks each.
    assert main(["train", "--devices", "8", "--tp", "8", "--max-steps", "1"]) == 2
    said = capsys.readouterr().err
    assert "blocks.0.attn of GPT has 4, not a multiple of 8" in said
    assert said.count("gpukit train: error") == 1
