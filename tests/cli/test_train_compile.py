"""`gpukit train --compile`: for single, ddp and fsdp, on every rank; refused by dp; auto decided
from the devices, the run's length and the model's size (gpukit.train.fast), and said."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.cli.__main__ import build_parser, main
from gpukit.cli.train import _worker_command
from gpukit.train import options
from gpukit.train.options import TrainConfig


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_compile_reaches_every_rank_for_every_strategy_that_compiles(strategy: str) -> None:
    command = _worker_command(parse("--strategy", strategy, "--compile"), strategy)
    assert command[command.index("--compile") + 1] == "on"  # --compile alone: on
    plain = _worker_command(parse("--strategy", strategy), strategy)
    assert plain[plain.index("--compile") + 1] == "auto"  # each rank decides as the others
    moded = _worker_command(parse("--strategy", strategy, "--compile", "max-autotune"), strategy)
    assert moded[moded.index("--compile") + 1] == "max-autotune"


def test_an_unknown_compile_mode_is_refused_with_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_code:
        parse("--compile", "fastest")
    assert exit_code.value.code == 2
    err = capsys.readouterr().err
    assert "'fastest'" in err and "reduce-overhead" in err and "auto" in err


def test_a_config_file_from_before_reads_true_and_false_as_on_and_off(tmp_path: Path) -> None:
    from gpukit.cli._config_file import file_defaults

    parser = parse().config_parser
    for written, read in [("true", "on"), ("false", "off"), ('"max-autotune"', "max-autotune")]:
        path = tmp_path / "run.toml"
        path.write_text(f"compile = {written}\n")
        assert file_defaults(parser, path) == {"compile": read}


def test_auto_on_a_cpu_stays_eager_and_says_so_in_metrics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--workload", "mlp", "--max-steps", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["runtime"]["compile"] is False
    assert metrics["config"]["compile"] == "auto"
    assert metrics["fast"] == {
        "tf32": False,
        "fused_adamw": False,  # a CPU run is a plain loop's, bit for bit
        "compile": {
            "asked": "auto",
            "used": False,
            "why": "eager: compiling pays off on a GPU, and this run trains on a CPU",
        },
    }
    assert "torch.compile" not in capsys.readouterr().out  # no row on a CPU run


def test_auto_on_a_gpu_decides_from_the_runs_length(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpukit.cli import train as train_cli
    from gpukit.devices.device import Device

    gpu = Device("cuda", 0, "NVIDIA H100 80GB HBM3", 80 << 30, (9, 0))
    monkeypatch.setattr(train_cli, "resolve_devices", lambda spec, launched: [gpu])
    args = parse("--workload", "gpt", "--max-steps", "100")
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in options.flags()})
    short = train_cli._compile_choice(args, config)
    assert short.setting is False and "100 steps are too few" in short.why
    args = parse("--workload", "gpt", "--max-steps", "600")
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in options.flags()})
    small = train_cli._compile_choice(args, config)
    assert small.setting == "reduce-overhead" and "600 steps" in small.why
    args = parse("--workload", "gpt", "--max-steps", "600", "--compile", "off")
    assert train_cli._compile_choice(args, config).setting is False


@pytest.mark.parametrize("strategy", ["dp", "dp-balanced"])
def test_compile_with_dp_is_refused_naming_ddp(
    strategy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--workload", "mlp", "--max-steps", "1", "--devices", "2"]
    assert main([*argv, "--strategy", strategy, "--compile"]) == 2
    err = capsys.readouterr().err
    assert f"strategy {strategy!r}" in err and "--strategy ddp --compile" in err
    assert "Traceback" not in err


@pytest.mark.processes  # inductor runs the C++ compiler
def test_a_compiled_single_run_records_it(tmp_path: Path) -> None:
    argv = ["--workload", "mlp", "--max-steps", "3", "--out", str(tmp_path), "--compile"]
    assert main(["train", *argv]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["runtime"]["compile"] is True and metrics["steps"] == 3
    assert metrics["fast"]["compile"] == {"asked": "on", "used": True, "why": "on (--compile on)"}


def test_auto_weighs_the_steps_a_resumed_run_has_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpukit.cli import train as train_cli
    from gpukit.devices.device import Device

    argv = ["--workload", "gpt", "--out", str(tmp_path), "--progress-every", "0"]
    assert main(["train", *argv, "--max-steps", "2"]) == 0  # a checkpoint at step 2
    gpu = Device("cuda", 0, "NVIDIA H100 80GB HBM3", 80 << 30, (9, 0))
    monkeypatch.setattr(train_cli, "resolve_devices", lambda spec, launched: [gpu])

    def choice(*more: str) -> train_cli.Compile:
        args = parse(*argv, "--max-steps", "501", *more)
        return train_cli._compile_choice(
            args, TrainConfig(**{f.name: getattr(args, f.name) for f in options.flags()})
        )

    assert choice().setting == "reduce-overhead"  # a new run of 501 steps
    resumed = choice("--resume")
    assert resumed.setting is False and "499 steps are too few" in resumed.why
