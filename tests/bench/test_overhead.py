"""The wrapper-overhead benchmark: it measures the right loops, reports what it could not run,
and refuses bad settings. Timings are only checked for being there, never for their size."""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from gpukit._util.text import render_plain
from gpukit.bench import overhead_loops as loops
from gpukit.bench.overhead import run_overhead
from gpukit.bench.overhead_loops import make_batches, make_model_and_optimizer
from gpukit.bench.overhead_result import as_result
from gpukit.bench.timing import torch_threads
from gpukit.cli import bench
from gpukit.errors import ConfigError
from gpukit.launch import heartbeat
from gpukit.launch.heartbeat import Heartbeat
from gpukit.runtime.runtime import Runtime

Builder = Callable[[nn.Module, Optimizer], loops.Loop]
FRAMEWORK_MODULES = ("accelerate", "lightning", "lightning.fabric", "lightning_fabric")
GPUKIT_VARIANTS = ("gpukit", "gpukit-train-step", "gpukit-train-default")
LOGGER_VARIANTS = ("gpukit+csv", "gpukit+tensorboard")
ALL_VARIANTS = [
    "plain",
    "plain-logged",
    *GPUKIT_VARIANTS,
    *LOGGER_VARIANTS,
    "gpukit+heartbeat",
    "accelerate",
    "fabric",
]


@pytest.fixture
def no_frameworks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Accelerate and Fabric fail to import, whether or not they are installed."""
    for name in FRAMEWORK_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: ImportError


@pytest.fixture
def fake_accelerate(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """An importable ``accelerate`` that does what the real one does on one CPU."""

    class Accelerator:
        def __init__(self, cpu: bool = False) -> None:
            assert cpu, "the benchmark must ask for the CPU"

        def prepare(self, *objects: object) -> tuple[object, ...]:
            return objects

        def backward(self, loss: torch.Tensor) -> None:
            loss.backward()

    module = types.ModuleType("accelerate")
    module.Accelerator = Accelerator  # type: ignore[attr-defined]
    module.__version__ = "0.0-fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "accelerate", module)
    return module


def trained(build: Builder, steps: int = 8) -> dict[str, torch.Tensor]:
    """The weights after ``steps`` steps of ``build``'s loop from the benchmark's start,
    on one thread as in the benchmark (a busy 2-core machine makes 2 threads crawl)."""
    with torch_threads(1):
        model, optimizer = make_model_and_optimizer()
        build(model, optimizer)(make_batches(steps))
    return model.state_dict()


def test_plain_and_every_gpukit_variant_are_timed_every_round(no_frameworks: None) -> None:
    result = run_overhead(steps=5, rounds=2)
    assert [v.name for v in result.variants] == ALL_VARIANTS
    plain = result.variant("plain")
    for v in (plain, *map(result.variant, GPUKIT_VARIANTS)):
        assert v.available and v.note == "" and v.version
        assert len(v.seconds) == 2 and all(s > 0 for s in v.seconds)
        assert v.seconds_per_step is not None and v.seconds_per_step > 0
        assert v.ratio is not None and v.ratio > 0
    assert plain.ratio == 1.0 and plain.ratios == (1.0, 1.0)
    logged = result.variant("gpukit-train-default")  # it logs: compared with a loop that does
    assert logged.baseline == "plain-logged" and logged.baseline_ratio is not None
    assert result.variant("gpukit").baseline == "plain"
    for name in LOGGER_VARIANTS:  # the same loop with a logger: compared with plain-logged too
        v = result.variant(name)
        if v.available:  # tensorboard is optional
            assert v.baseline == "plain-logged" and len(v.baseline_ratios) == 2
    assert result.environment["threads"] == 1 and result.environment["device"] == "cpu"


def test_missing_frameworks_are_reported_not_installed(no_frameworks: None) -> None:
    result = run_overhead(steps=5, rounds=2)
    for name in ("accelerate", "fabric"):
        v = result.variant(name)
        assert not v.available and v.note == "not installed"
        assert v.seconds_per_step is None and v.ratio is None and v.version is None
    text = render_plain(result.table())
    assert text.count("not installed") == 2 + (not result.variant(LOGGER_VARIANTS[1]).available)
    assert all(f"│ {name} " in text for name in ALL_VARIANTS)


def test_each_variant_records_what_its_wrapper_was_built_with(no_frameworks: None) -> None:
    result = run_overhead(steps=2, rounds=1)
    assert result.variant("plain").settings == {}
    assert result.variant("gpukit").settings == {"devices": "cpu", "precision": "32"}
    assert result.variant("gpukit-train-step").settings == {"devices": "cpu"}
    default = result.variant("gpukit-train-default").settings
    assert default == loops.train_default() and default["log_every"] == 10
    assert result.variant("fabric").settings == {"accelerator": "cpu", "devices": 1}
    text = render_plain(result.table())
    assert f"oom={default['oom']}" in text and "log_every=10" in text


def test_the_heartbeat_is_timed_against_the_same_loop_without_it(
    no_frameworks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []
    real = loops.Heartbeat

    def noted(folder: str, rank: int) -> Heartbeat:
        written.append(Path(folder))
        return real(folder, rank)

    monkeypatch.setattr(loops, "Heartbeat", noted)
    result = run_overhead(steps=5, rounds=2)
    v = result.variant("gpukit+heartbeat")
    assert v.available and v.baseline == "gpukit-train-default" and len(v.baseline_ratios) == 2
    assert v.settings == loops.train_default()
    assert as_result(result).summary["heartbeat x gpukit-train-default"] == v.baseline_ratio
    # Beats were written, as under the launcher: each copy's own record, the step's phases.
    assert written and not any(folder.exists() for folder in written)  # removed with the loop


def test_the_heartbeat_loop_beats_every_step() -> None:
    model, optimizer = make_model_and_optimizer()
    train = loops.heartbeat_loop(model, optimizer)
    train(make_batches(3))
    folder = train.__defaults__[0].name  # type: ignore[attr-defined]
    beat = heartbeat.read(folder, 0)
    assert beat is not None and beat.step == 3 and beat.phase == "loop"
    assert beat.spent_in("forward") > 0 and beat.step_ended_at > 0


def test_an_installed_framework_is_timed_beside_the_others(
    no_frameworks: None, fake_accelerate: types.ModuleType
) -> None:
    v = run_overhead(steps=5, rounds=2).variant("accelerate")
    assert v.available and v.version == "0.0-fake" and len(v.ratios) == 2


def test_a_framework_that_breaks_costs_only_its_own_row(
    no_frameworks: None, fake_accelerate: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(cpu: bool) -> None:
        raise RuntimeError("needs a newer torch")

    monkeypatch.setattr(fake_accelerate, "Accelerator", broken)
    result = run_overhead(steps=5, rounds=2)
    assert result.variant("accelerate").note == "failed: RuntimeError: needs a newer torch"
    assert result.variant("gpukit").available


def test_json_has_the_settings_the_machine_and_every_round(no_frameworks: None) -> None:
    data = json.loads(json.dumps(run_overhead(steps=5, rounds=2).to_dict()))
    assert data["schema_version"] == 1 and data["benchmark"] == "overhead"
    assert (data["steps"], data["rounds"], data["warmup_steps"]) == (5, 2, 5)
    assert data["workload"]["device"] == "cpu" and data["workload"]["batch_size"] == 64
    assert set(data["environment"]) >= {
        "date",
        "command",
        "python",
        "torch",
        "cpu",
        "threads",
        "device",
        "gpukit",
    }
    assert [v["name"] for v in data["variants"]] == ALL_VARIANTS
    for v in data["variants"]:
        assert set(v) == {
            "name",
            "available",
            "version",
            "note",
            "seconds_per_step",
            "ratio_to_plain",
            "seconds_per_step_by_round",
            "ratio_to_plain_by_round",
            "settings",
            "baseline",
            "ratio_to_baseline",
        }
    by_name = {v["name"]: v for v in data["variants"]}
    assert by_name["plain"]["ratio_to_plain"] == 1.0
    assert all(len(by_name[n]["ratio_to_plain_by_round"]) == 2 for n in GPUKIT_VARIANTS)
    assert by_name["accelerate"]["seconds_per_step"] is None


@pytest.mark.parametrize(
    "build",
    [
        loops.gpukit_loop,
        loops.train_step_loop,
        loops.train_default_loop,
        loops.plain_logged_loop,
        loops.logger_loop("csv"),
        loops.heartbeat_loop,
    ],
)
def test_gpukit_loops_do_exactly_the_same_arithmetic_as_plain(build: Builder) -> None:
    """Bit for bit, because each gpukit variant computes the same float32 operations in the
    same order: no autocast (precision "32", also what "auto" gives on the CPU), and one
    micro-batch per step, where ``rt.train_step`` backpropagates the loss itself (with more
    micro-batches it weights each loss by its share of the batch, which rounds differently).
    ``rt.log`` and the OOM snapshot only read. The premises are checked first, so that a
    changed default fails here with its reason rather than as a mismatch of weights."""
    for settings in (loops.GPUKIT, loops.TRAIN_STEP, loops.train_default()):
        rt = Runtime(**settings)
        assert (rt.precision.name, rt.accumulate) == ("32", 1), settings
    start = make_model_and_optimizer()[0].state_dict()
    plain, other = trained(loops.plain_loop), trained(build)
    assert plain.keys() == other.keys()
    for name in plain:
        assert not torch.equal(plain[name], start[name]), f"{name} did not train"
        assert torch.equal(plain[name], other[name]), f"{name} differs"


@pytest.mark.parametrize(
    ("build", "module"),
    [(loops.accelerate_loop, "accelerate"), (loops.fabric_loop, "lightning.fabric")],
)
def test_framework_loops_do_the_same_work_as_plain(build: Builder, module: str) -> None:
    pytest.importorskip(module)
    plain, other = trained(loops.plain_loop), trained(build)
    for name in plain:
        torch.testing.assert_close(other[name], plain[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("steps", "rounds", "given"),
    [(0, 15, "steps=0"), (200, 0, "rounds=0"), (-3, 15, "steps=-3"), (2.5, 15, "steps=2.5")],
)
def test_bad_steps_or_rounds_are_a_config_error(steps: int, rounds: int, given: str) -> None:
    with pytest.raises(ConfigError, match="at least 1") as info:
        run_overhead(steps=steps, rounds=rounds)
    assert str(info.value).startswith(given)


# -- the command line ------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    """What `gpukit bench ...` parses to, with this module registered as __main__ will."""
    parser = argparse.ArgumentParser(prog="gpukit")
    bench.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_cli_json_goes_to_stdout_and_to_the_file(
    no_frameworks: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overhead.json"
    args = parse("overhead", "--json", "--steps", "3", "--rounds", "2", "--out", str(out))
    assert args.run(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["parameters"]["steps"] == 3
    assert printed["experiment"] == "overhead"
    raw = {v["name"]: v for v in printed["raw"]["variants"]}
    assert len(raw["gpukit"]["seconds_per_step_by_round"]) == 2  # every round kept


def test_cli_out_folder_gets_the_json_and_the_plot(
    no_frameworks: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse("overhead", "--steps", "2", "--rounds", "1", "--out", str(tmp_path / "new"))
    assert args.run(args) == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["overhead.json", "overhead.png"]


def test_the_suite_result_has_a_row_per_variant(no_frameworks: None) -> None:
    result = as_result(run_overhead(steps=3, rounds=2))
    assert [r["variant"] for r in result.rows] == ALL_VARIANTS
    rows = {r["variant"]: r for r in result.rows}
    assert rows["plain"]["ratio"] == 1.0 and rows["accelerate"]["note"] == "not installed"
    assert rows["gpukit-train-default"]["ratio_to_baseline"] is not None


def test_cli_table(no_frameworks: None, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("overhead", "--steps", "3", "--rounds", "1")
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "overhead: 3 steps x 1 rounds" in out and "not installed" in out
    assert all(f"│ {name} " in out for name in ALL_VARIANTS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--steps", "0"), "--steps 0: give a whole number of at least 1"),
        (("--rounds", "-1"), "--rounds -1: give a whole number of at least 1"),
        (("--out", "/no/such/folder/x.json"), "--out /no/such/folder/x.json: the folder"),
        (("--out", "/proc/no-folder-here"), "--out /proc/no-folder-here: cannot write there"),
    ],
)
def test_cli_bad_input_is_a_config_error(argv: tuple[str, ...], message: str) -> None:
    args = parse("overhead", *argv)
    with pytest.raises(ConfigError) as info:
        args.run(args)
    assert str(info.value).startswith(message)


def test_cli_needs_an_experiment_and_shows_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse()
    with pytest.raises(SystemExit):
        parse("overhead", "--help")
    assert "Example:" in capsys.readouterr().out
