"""`gpukit train --compile`: for single, ddp and fsdp, on every rank; refused by dp."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.cli.__main__ import build_parser, main
from gpukit.cli.train import _worker_command


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_compile_reaches_every_rank_for_every_strategy_that_compiles(strategy: str) -> None:
    command = _worker_command(parse("--strategy", strategy, "--compile"), strategy)
    assert "--compile" in command
    assert "--compile" not in _worker_command(parse("--strategy", strategy), strategy)


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
