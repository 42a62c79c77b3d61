"""``parallel="auto"``: the planner's layout for the model, asked at its first ``rt.setup``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.planning import auto_layout
from gpukit.strategies import layout_choice
from gpukit.workloads.llama import llama3_70b


def _gpu() -> SimpleNamespace:
    return SimpleNamespace(type="cuda", index=0)


def test_on_gpus_the_layout_planner_chooses_for_a_model_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    model = llama3_70b().model
    sizes, why = auto_layout.choose(model, 64, _gpu())  # type: ignore[arg-type]
    product = 1
    for size in sizes.values():  # every dimension: cp too
        product *= size
    assert product == 64
    assert sizes["tp"] > 1 or sizes["pp"] > 1  # 70B does not fit 64 GPUs by sharding alone
    assert "fits in" in why


def test_on_gpus_a_model_the_planner_cannot_read_is_sharded_and_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    sizes, why = auto_layout.choose(torch.nn.Linear(4, 4), 8, _gpu())  # type: ignore[arg-type]
    assert sizes == {"dp_shard": 8}
    assert "reads Llama-style decoders, not Linear" in why


def test_a_model_that_fits_no_layout_is_the_planners_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    with pytest.raises(ConfigError, match="parallel='auto'"):
        auto_layout.choose(llama3_70b().model, 1, _gpu())  # type: ignore[arg-type]


def test_on_the_cpu_auto_shards_over_every_rank_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = gk.Runtime(parallel="auto", devices="cpu")
    with caplog.at_level("WARNING", logger="gpukit"):
        rt.setup(torch.nn.Linear(4, 4))
    assert rt.strategy.layout.described() == "dp_shard 1"
    assert "parallel layout dp_shard 1: every rank shards the model (fsdp)" in caplog.text
    rt.teardown()


def test_on_gpus_the_layout_is_planned_with_the_runs_activation_checkpointing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without recomputation 70B's activations need more of each GPU: a layout chosen as if
    # every block were recomputed would not fit the run that keeps them.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100 80GB HBM3")
    model = llama3_70b().model
    kept, _ = auto_layout.choose(model, 64, _gpu(), activation_checkpointing="off")  # type: ignore[arg-type]
    recomputed, _ = auto_layout.choose(model, 64, _gpu(), activation_checkpointing="full")  # type: ignore[arg-type]
    assert kept != recomputed
    assert (
        kept["tp"] * kept["pp"] * kept["cp"]
        > recomputed["tp"] * recomputed["pp"] * recomputed["cp"]
    )


class _Asked(Exception):
    pass


def test_parallel_auto_asks_the_planner_with_its_own_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[dict[str, object]] = []

    def chooser(model: object, world_size: int, device: object, **settings: object) -> None:
        asked.append(settings)
        raise _Asked

    monkeypatch.setattr(layout_choice, "_CHOOSER", [chooser])
    strategy = gk.strategies.Parallel(layout="auto", activation_checkpointing="selective")
    rt = gk.Runtime(strategy=strategy, devices="cpu")
    with pytest.raises(_Asked):
        rt.setup(torch.nn.Linear(4, 4))
    assert asked == [{"activation_checkpointing": "selective", "float8": None}]
    rt.teardown()
