"""``gk.Runtime(parallel=...)`` and gpukit train's mesh flags (``--tp 2 --pp 2``): the one-mesh
strategy they make, and each bad input refused before any process starts."""

from __future__ import annotations

import pytest

import gpukit as gk
from gpukit.cli.__main__ import build_parser, main
from gpukit.cli._parallel_flags import parallel_setting as _parallel
from gpukit.cli.train import _worker_command
from gpukit.errors import ConfigError
from gpukit.workloads.gpt import GPT, GPTConfig


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


def test_strategy_parallel_alone_trains_every_rank_sharding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No size given: parallel={} (every rank sharding), not refused as beside a strategy.
    import gpukit.cli.train as train_command

    made: list[gk.Runtime] = []

    def runtime(**kwargs: object) -> gk.Runtime:
        made.append(gk.Runtime(**{**kwargs, "devices": ["cpu"] * 2}))  # type: ignore[arg-type]
        raise KeyboardInterrupt  # the Runtime is what is checked: stop before training

    monkeypatch.setattr(train_command, "Runtime", runtime)
    main(["train", "--strategy", "parallel", "--devices", "2", "--max-steps", "1"])
    assert len(made) == 1
    assert made[0].strategy.name == "parallel"
    assert made[0].strategy.layout.described() == "dp_shard 2"


def test_the_batch_is_checked_against_the_ranks_that_read_different_samples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 3 tensor-parallel ranks read the same 32 samples: the batch splits (over one data
    # rank); what is refused is gpt's 4 heads over 3 ranks, before any rank starts.
    assert main(["train", "--devices", "3", "--tp", "3", "--max-steps", "1"]) == 2
    said = capsys.readouterr().err
    assert "cannot be split over" not in said
    assert "has 4, not a multiple of 3" in said


def test_heads_context_parallel_cannot_split_are_refused_before_any_rank_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # gpt's 4 heads over 8 Ulysses ranks: said by the command, not by 8 ranks at a forward.
    assert main(["train", "--devices", "8", "--cp", "8", "--max-steps", "1"]) == 2
    said = capsys.readouterr().err
    assert "cp=8: blocks.0.attn of GPT has 4 attention heads" in said
    assert said.count("gpukit train: error") == 1


def test_heads_left_to_a_tensor_parallel_rank_must_split_across_the_context_ranks() -> None:
    # 4 heads, 2 on each tensor-parallel rank: 4 Ulysses ranks cannot split those 2.
    rt = gk.Runtime(parallel={"tp": 2, "cp": 4, "dp_shard": 1}, devices=["cpu"] * 8)
    model = GPT(GPTConfig(vocab_size=32, context=16, n_layer=1, n_head=4, d_model=32))
    with pytest.raises(ConfigError, match=r"4 attention heads, 2 on each of 2 tensor-parallel"):
        rt.strategy.check_model(model)


def test_compile_is_refused_for_the_context_ranks_the_layout_resolves_to() -> None:
    # cp=-1 over one rank is no context parallel: compile goes; over two it is refused.
    one = gk.Runtime(parallel={"dp_shard": 1, "cp": -1}, devices="cpu", compile=True)
    assert one.strategy.layout.cp == 1
    with pytest.raises(ConfigError, match="parallel cp=2 with compile"):
        gk.Runtime(parallel={"dp_shard": 1, "cp": -1}, devices=["cpu"] * 2, compile=True)
