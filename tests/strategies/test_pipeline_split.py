"""Pipeline stages cut from a model (names kept, tied copies found), and every setting or model
that cannot make a pipeline refused with its reason, before any process starts where it can
be."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies.pipeline import PipelineCriterion, PipelineOptions, PipelineOutput
from gpukit.strategies.pipeline_split import Cut, holding, stage_module, tied_names, union
from gpukit.workloads.gpt import GPT, GPTConfig


def _gpt(layers: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=11, context=8, n_layer=layers, n_head=2, d_model=16))


def test_stages_keep_the_whole_models_names_and_run_as_it_does() -> None:
    model = _gpt()
    cut = Cut.of(model, 2, None)
    first, last = (stage_module(model, cut, s) for s in range(2))
    assert [cut.described(s) for s in range(2)] == ["blocks.0..1", "blocks.2..3"]
    names = set(model.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == names
    assert "token_embedding.weight" in first.state_dict() and first.head is None
    assert "head.weight" in last.state_dict() and last.token_embedding is None
    ids = torch.randint(0, 11, (2, 8))
    torch.testing.assert_close(last(first(ids)), model(ids), rtol=0, atol=0)
    assert set(union([first, last]).state_dict()) == names


def test_the_tied_head_is_held_by_the_first_and_the_last_stage() -> None:
    model = _gpt()
    cut = Cut.of(model, 4, None)
    (tied,) = tied_names(model)
    assert sorted(tied) == ["head.weight", "token_embedding.weight"]
    assert sorted(s for n in tied for s in holding(model, cut, n)) == [0, 3]
    assert holding(model, cut, "blocks.2.ln1.weight") == [2]


def test_blocks_that_do_not_divide_go_to_the_earlier_stages() -> None:
    assert Cut.of(_gpt(5), 2, None).bounds == ((0, 3), (3, 5))


def test_split_points_cut_a_sequential_where_the_user_says() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    cut = Cut.of(model, 2, ["2"])
    first, last = (stage_module(model, cut, s) for s in range(2))
    x = torch.randn(3, 4)
    torch.testing.assert_close(last(first(x)), model(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("model", "stages", "split", "said"),
    [
        (_gpt(2), 4, None, "4 stage(s) but GPT has 2 block(s) in blocks"),
        (nn.Linear(2, 2), 2, None, "no list of repeated blocks"),
        (_gpt(4), 2, ["blocks.9"], "blocks has no entry 9"),
        (_gpt(4), 2, ["blocks.1", "blocks.2"], "make 3 stage(s), but the layout has 2"),
        (_gpt(4), 3, ["blocks.2", "blocks.1"], "in order"),
        (_gpt(4), 2, ["blocks.0"], "after the list's first entry"),
        (_gpt(4), 3, ["blocks.1", "ln_f"], "entries of one nn.Sequential"),
        (_gpt(4), 2, "blocks.2", "give a list of module names"),
    ],
)
def test_a_model_that_cannot_be_cut_is_refused(
    model: nn.Module, stages: int, split: Any, said: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        Cut.of(model, stages, split)
    assert said in str(caught.value)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"pp_schedule": "2F2B"}, "pp_schedule='2F2B': give one of GPipe, 1F1B"),
        ({"pp_microbatches": 0}, "pp_microbatches=0"),
        ({"pp_schedule": "1F1B", "pp_stages_per_rank": 2}, "runs one stage per rank"),
        ({"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, "two stages per rank"),
    ],
)
def test_bad_pipeline_settings_are_refused_at_once(options: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError) as caught:
        gk.strategies.Parallel(pp=2, **options)
    assert said in str(caught.value)


def test_zero_bubble_schedules_refuse_checkpointing_and_compiled_blocks() -> None:
    for options in ({"activation_checkpointing": "full"}, {"compile": True}):
        with pytest.raises(ConfigError, match="splits each backward in two"):
            gk.strategies.Parallel(pp=2, pp_schedule="InterleavedZeroBubble", **options)


def test_pipeline_settings_without_a_pipeline_are_refused() -> None:
    strategy = gk.strategies.Parallel(dp_shard=2, pp_schedule="GPipe")
    with pytest.raises(ConfigError, match="with pp=1"):
        gk.Runtime(strategy=strategy, devices=["cpu"] * 2)


def test_float16_with_its_scaler_is_refused_with_the_reason() -> None:
    strategy = gk.strategies.Parallel(dp_shard=1, pp=2)
    strategy.configure([gk.device("cpu")] * 2)
    with pytest.raises(ConfigError, match="inside the forward"):
        strategy.check_precision("16-mixed")


def test_stages_sit_on_ranks_as_each_schedule_places_them() -> None:
    assert PipelineOptions("1F1B").stage_ids(2, 1) == [1]
    assert PipelineOptions("Interleaved1F1B").stage_ids(2, 0) == [0, 2]
    assert PipelineOptions("ZBVZeroBubble").stage_ids(2, 0) == [0, 3]
    assert [PipelineOptions("ZBVZeroBubble").holder(s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert PipelineOptions("1F1B").microbatches_for(4) == 4


def test_the_stand_in_for_outputs_refuses_a_plain_loss_function() -> None:
    out = PipelineOutput.made(None, (), {})  # type: ignore[arg-type]
    assert out.shape == (0,)  # metadata stays readable (a check of the targets reads it)
    with pytest.raises(ConfigError, match=r"rt\.setup_criterion"):
        torch.nn.functional.cross_entropy(out, torch.zeros(0, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"rt\.setup_criterion"):
        out.flatten(0, 1)
    with pytest.raises(ConfigError, match="takes \\(outputs, targets\\) only"):
        PipelineCriterion(nn.MSELoss())(out, torch.zeros(0), torch.zeros(0))
