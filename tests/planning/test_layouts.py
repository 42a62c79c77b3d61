"""The layout planner: each size checked against the model and GPUs, with a clear error for
each bad input; the search, its one-line reason, choose_layout, and `gpukit plan`'s flags."""

from __future__ import annotations

import functools
import json

import pytest

import gpukit as gk
from gpukit.cli.__main__ import main
from gpukit.devices import hw
from gpukit.errors import ConfigError
from gpukit.planning import choose_layout
from gpukit.planning.layout_memory import layout_memory, stage_layers
from gpukit.planning.layout_search import AS_FAST, LayoutReport
from gpukit.planning.layout_shape import TransformerShape, shape_of
from gpukit.planning.layout_time import layout_time
from gpukit.planning.layouts import Layout, candidates, check
from gpukit.planning.targets import target
from gpukit.workloads.llama import LlamaShape, llama3_8b

L70 = TransformerShape(8192, 80, 64, 8, 28672, 128256, 8192)


@pytest.mark.parametrize(
    ("layout", "gpus", "says"),
    [
        (Layout(tp=3), 3, "does not divide the 64 attention heads"),
        (Layout(tp=16), 16, "spans more than a node's 8 GPUs"),
        (Layout(dp_shard=4), 8, "is 4 GPUs, not the 8 planned"),
        (Layout(cp=3), 3, "does not divide the sequence of 8192 tokens"),
        (Layout(pp=64, pp_schedule="Interleaved1F1B"), 64, "128 stages, more than the 80"),
        (Layout(pp_schedule="Bubbly"), 1, "pp_schedule='Bubbly': choose among GPipe"),
        (Layout(float8="int4"), 1, "float8='int4': choose among tensorwise, rowwise"),
        (Layout(tp=0), 1, "tp=0: give a whole number of GPUs"),
        (Layout(pp=4, microbatches=0), 4, "microbatches=0"),
        (Layout(pp=4), 4, "micro-batches must divide the local batch and number at least pp"),
        (Layout(microbatches=4), 1, "microbatches=4 with pp=1"),
    ],
)
def test_each_bad_layout_is_a_config_error_naming_it(layout: Layout, gpus: int, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        check(layout, L70, gpus, local_batch=2)


def test_search_lists_only_valid_layouts_of_the_gpus() -> None:
    found = candidates(L70, 64, local_batch_of=64)
    assert found and all(layout.gpus == 64 and layout.tp <= 8 for layout in found)
    assert {layout.pp_schedule for layout in found if layout.pp > 1} == {
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "InterleavedZeroBubble",
    }


def test_stage_split_and_schedules_order_memory_and_bubble() -> None:
    assert stage_layers(126, 8) == [15, 16, 16, 16, 16, 16, 16, 15]
    h100 = target("h100")
    times, held = {}, {}
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble"):
        layout = Layout(dp_shard=4, tp=8, pp=8, pp_schedule=schedule, microbatches=16)
        times[schedule] = layout_time(L70, layout, h100, local_batch=16).pipeline_bubble_s
        held[schedule] = layout_memory(L70, layout, local_batch=16)["activations"]
    assert (
        times["InterleavedZeroBubble"]
        == 0
        < times["Interleaved1F1B"]
        < times["1F1B"]
        == times["GPipe"]
    )
    assert held["GPipe"] > held["1F1B"]


def test_float8_is_refused_on_a_gpu_without_float8_tensor_cores() -> None:
    for layout in ({"dp_shard": 8, "float8": "rowwise"}, Layout(dp_shard=8, float8="rowwise")):
        with pytest.raises(ConfigError, match="float8='rowwise' on A100 80GB: it has no float8"):
            gk.plan_layout(L70, devices=8, target="a100", layout=layout)
    with pytest.raises(ConfigError, match="float8='tensorwise' on A100 80GB"):
        gk.plan_layout(L70, devices=8, target="a100", float8="tensorwise")


def test_float8_speeds_up_only_where_the_gpu_has_float8_tensor_cores() -> None:
    plain, fp8 = Layout(dp_shard=8, tp=8), Layout(dp_shard=8, tp=8, float8="rowwise")
    for name, faster in (("h100", True), ("a100", False)):
        a = layout_time(L70, plain, target(name), local_batch=1).compute_s
        b = layout_time(L70, fp8, target(name), local_batch=1).compute_s
        assert (b < a) is faster


def test_auto_picks_the_fastest_that_fits_and_says_why() -> None:
    report = gk.plan_layout(L70, devices=64, batch=64, target="h100")
    best = report.best
    assert best is not None and best.fits
    speeds = [p.time.tokens_per_s_per_gpu for p in report.fitting]
    assert best.time.tokens_per_s_per_gpu >= max(speeds) * (1 - AS_FAST)
    close = [p for p in report.fitting if p.time.tokens_per_s_per_gpu >= max(speeds) * 0.99]
    assert best.peak_bytes == min(p.peak_bytes for p in close)  # the headroom decides a tie
    assert report.reason.startswith(best.layout.describe() + ": fits in")
    assert "fastest of" in report.reason
    assert "as fast (within 1%), needing" in report.reason or "would fit too" in report.reason
    assert f"{len(report.plans)} layout(s) of 64 H100 GPUs (10 shown, the fastest" in str(report)
    assert len(str(report).splitlines()) == 1 + 10 + 1  # the title, 10 layouts, the plan


def test_a_slower_runner_up_is_named_with_its_main_cost() -> None:
    llama_8b = TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192)
    report = gk.plan_layout(llama_8b, devices=8, batch=64, target="h100")
    assert report.best is not None
    assert "would fit too but is" in report.reason and "% of its step" in report.reason


def test_nothing_fits_says_what_holds_the_least() -> None:
    report = gk.plan_layout(L70, devices=8, batch=8, memory=2**30)
    assert report.best is None and "nothing of" in report.reason and "needs" in report.reason
    assert "checkpointing" not in report.reason  # full already
    lighter = gk.plan_layout(L70, devices=8, batch=8, memory=2**30, activation_checkpointing="off")
    assert "or full checkpointing" in lighter.reason
    with pytest.raises(ConfigError, match="parallel='auto': nothing of"):
        choose_layout(L70, 8, gk.planning.targets.with_memory(target("h100"), 2**30), batch=8)


def test_choose_layout_returns_the_five_degrees_and_a_reason() -> None:
    degrees, reason = choose_layout(llama3_8b(seq_len=4096), 16, "h100", batch=32)
    assert set(degrees) == {"dp_replicate", "dp_shard", "tp", "pp", "cp"}
    product = 1
    for size in degrees.values():
        product *= size
    assert product == 16 and "fits in" in reason


def test_shape_from_a_workload_a_shape_and_bad_models() -> None:
    w = llama3_8b(seq_len=2048, sizes={"layers": 2})
    assert shape_of(w) == shape_of(LlamaShape(layers=2), seq_len=2048)
    with pytest.raises(ConfigError, match="a LlamaShape has no sequence length"):
        shape_of(LlamaShape())
    with pytest.raises(ConfigError, match="seq_len=0"):
        shape_of(w, seq_len=0)
    with pytest.raises(ConfigError, match="plans a Llama-style decoder; got int"):
        gk.plan_layout(3, devices=8)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"layout": "best"}, "layout='best': give 'auto'"),
        ({"layout": {"tq": 2}}, "layout has no tq"),
        ({"layout": [8]}, "layout=list"),
        ({"layout": {"dp_shard": 8}, "batch": 12}, "batch=12 does not split over 8"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing='some'"),
        ({"target": "cpu"}, "layouts are planned for GPUs"),
        ({"devices": 7, "batch": 2}, "no layout of 7 GPUs"),
        (
            {"layout": Layout(dp_shard=8), "float8": "tensorwise"},
            "float8='tensorwise' and a layout whose float8 is None",
        ),
        (
            {"layout": {"dp_shard": 8, "float8": "rowwise"}, "float8": "tensorwise"},
            "a layout whose float8 is 'rowwise': give it once",
        ),
        (
            {"layout": Layout(dp_shard=2, tp=4), "async_tp": True},
            "async_tp=True and a layout whose async_tp is False",
        ),
    ],
)
def test_bad_plan_layout_arguments(kwargs: dict[str, object], says: str) -> None:
    given = {"devices": 8, **kwargs}
    with pytest.raises(ConfigError, match=says):
        gk.plan_layout(L70, **given)  # type: ignore[arg-type]


def test_cli_plans_one_layout_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "plan",
            "--workload",
            "gpukit.workloads.llama:llama3_8b",
            "--devices",
            "8",
            "--tp",
            "2",
            "--dp-shard",
            "4",
            "--float8",
            "tensorwise",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["best"]["layout"]["tp"] == 2 and out["best"]["layout"]["float8"]
    assert out["reason"].startswith("tp 2 x dp_shard 4, float8 tensorwise")


def test_cli_shards_over_what_the_other_sizes_leave(capsys: pytest.CaptureFixture[str]) -> None:
    """As gpukit train takes --tp 2 --pp 2 on 8 GPUs: dp_shard is the 2 they leave."""
    args = ["--devices", "8", "--tp", "2", "--pp", "2", "--batch-size", "16", "--json"]
    assert main(["plan", "--workload", "gpukit.workloads.llama:llama3_8b", *args]) == 0
    layout = json.loads(capsys.readouterr().out)["plans"][0]["layout"]
    assert (layout["dp_shard"], layout["tp"], layout["pp"], layout["dp_replicate"]) == (2, 2, 2, 1)
    given = ["--devices", "8", "--tp", "2", "--dp-shard", "2"]  # given: kept, and refused
    assert main(["plan", "--workload", "gpukit.workloads.llama:llama3_8b", *given]) != 0
    assert "is 4 GPUs, not the 8 planned" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--devices", "8,16", "--layout", "auto"], "give one GPU count"),
        (["--devices", "8", "--layout", "auto", "--tp", "2"], "either --layout auto or the sizes"),
        (["--devices", "8", "--tp", "2", "--strategies", "fsdp"], "plan strategies, not layouts"),
        (["--devices", "8", "--float8", "rowwise"], "--float8 plan layouts: add --layout auto"),
        (["--devices", "8", "--async-tp", "--pp-schedule", "GPipe"], "--pp-schedule, --async-tp"),
        (["--devices", "8", "--tp", "8", "--pp-schedule", "GPipe"], "give --pp above 1 with it"),
        (["--layout", "auto"], "one GPU count, and --devices was not given"),
        (["--devices", "8", "--tp", "2", "--accumulate", "2"], "--accumulate plan strategies"),
        (["--devices", "8", "--layout", "auto", "--precision", "32"], "--precision plan strat"),
        (["--devices", "8", "--layout", "auto", "--method", "closed-form"], "--method plan"),
        (["--devices", "8", "--layout", "auto", "--microbatches", "4"], "--microbatches 4 splits"),
        (["--devices", "8", "--microbatches", "0"], "--microbatches plan layouts"),
    ],
)
def test_cli_refuses_mixed_layout_flags(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plan", "--workload", "gpukit.workloads.llama:llama3_8b", *extra])
    assert code != 0 and says in capsys.readouterr().err


def test_gk_plan_with_a_layout_plans_layouts() -> None:
    report = gk.plan(
        functools.partial(llama3_8b, seq_len=4096, sizes={"layers": 4}),
        devices=8,
        batch=8,
        layout={"tp": 2, "dp_shard": 4},
        float8="tensorwise",
    )
    assert isinstance(report, LayoutReport) and report.target.name == "H100"
    assert report.plans[0].layout.float8 == "tensorwise"
    assert report.activation_checkpointing == "full"


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"layout": "auto", "strategies": ["fsdp"]}, "strategies with layout='auto': those plan"),
        ({"layout": "auto", "fsdp_mixed": "bf16", "precision": "32"}, "precision, fsdp_mixed"),
        ({"layout": "auto", "devices": [8, 16]}, "give one GPU count"),
        ({"float8": "rowwise"}, "float8 and async_tp are settings of layouts"),
    ],
)
def test_gk_plan_refuses_strategy_settings_with_a_layout(
    kwargs: dict[str, object], says: str
) -> None:
    given = {"devices": 8, **kwargs}
    with pytest.raises(ConfigError, match=says):
        gk.plan(L70, **given)  # type: ignore[call-overload]


def test_choose_layout_on_this_machine_without_a_gpu_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hw, "cuda_count", lambda: 0)
    with pytest.raises(ConfigError, match="layouts are planned for GPUs with a bf16 peak"):
        choose_layout(L70, 8, "cuda", batch=8)
