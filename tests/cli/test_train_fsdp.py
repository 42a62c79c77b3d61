"""`gpukit train --strategy fsdp`: its flags, and a sharded run over two gloo processes from
the command line to its summary, metrics, checkpoints and resume."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpukit.cli.__main__ import build_parser, main
from gpukit.cli.train import _strategy, _worker_command


def parse(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["train", *argv])


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--activation-checkpointing", "full"], "--activation-checkpointing"),
        (
            ["--strategy", "single", "--activation-checkpointing", "off"],
            "--activation-checkpointing",
        ),
        (["--fsdp-mixed", "bf16"], "--fsdp-mixed"),
        (["--strategy", "ddp", "--fsdp-mixed", "bf16"], "--fsdp-mixed"),
    ],
)
def test_fsdp_flags_with_another_strategy_are_a_usage_error(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--max-steps", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert named in err and "--strategy fsdp" in err
    assert "Traceback" not in err


def test_the_fsdp_flags_reach_the_strategy_and_every_rank() -> None:
    args = parse("--strategy", "fsdp", "--activation-checkpointing", "selective", "--compile")
    strategy = _strategy(args)
    assert strategy.name == "fsdp"
    assert strategy.options.activation_checkpointing == "selective"
    # --compile is the Runtime's, which has fsdp compile each block.
    assert strategy.options.compile is False and args.compile == "on"
    command = _worker_command(args, "fsdp")
    assert command[command.index("--activation-checkpointing") + 1] == "selective"
    assert command[command.index("--compile") + 1] == "on"
    plain = _worker_command(parse("--strategy", "fsdp"), "fsdp")
    assert "--activation-checkpointing" not in plain
    assert plain[plain.index("--compile") + 1] == "auto"  # each rank decides alike
    assert _strategy(parse("--strategy", "fsdp")).options.activation_checkpointing == "off"


def test_fsdp_mixed_reaches_the_strategy_every_rank_and_the_rerun_config() -> None:
    from gpukit.train.rerun import rerun_flags

    args = parse("--strategy", "fsdp", "--fsdp-mixed", "bf16")
    strategy = _strategy(args)
    assert strategy.options.mixed == "bf16"
    command = _worker_command(args, "fsdp")
    assert command[command.index("--fsdp-mixed") + 1] == "bf16"
    assert "--fsdp-mixed" not in _worker_command(parse("--strategy", "fsdp"), "fsdp")
    flags = rerun_flags({"workload": "gpt"}, "32", strategy.options)
    assert flags["fsdp_mixed"] == "bf16"
    assert "fsdp_mixed" not in rerun_flags({"workload": "gpt"}, "32", _strategy(parse()))


def test_an_unknown_checkpointing_mode_is_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse("--strategy", "fsdp", "--activation-checkpointing", "some")
    assert exit_.value.code == 2
    assert "off, full, selective" in capsys.readouterr().err.replace("'", "")


def test_the_help_names_fsdp_and_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    assert "ddp or fsdp" in text
    assert "--activation-checkpointing {off,full,selective}" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def train(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpukit", "train", "--workload", "gpt", "--devices", "2", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )


# One uninterrupted fsdp run serves the two tests below: the first compares it with ddp and
# resumes a copy of it, the second is its reference for a run whose rank is killed.
COMMON = ["--max-steps", "4", "--log-every", "1", "--save-every", "2", "--hang-timeout", "120"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ddp`` and ``fsdp``: the same 4 steps under each strategy, a checkpoint every 2."""
    folder = tmp_path_factory.mktemp("runs")
    for strategy in ("ddp", "fsdp"):
        done = train("--strategy", strategy, *COMMON, "--out", str(folder / strategy))
        assert done.returncode == 0, done.stderr[-3000:]
        (folder / f"{strategy}.stdout").write_text(done.stdout)
    return folder


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.xdist_group("train-fsdp")
def test_fsdp_trains_like_ddp_from_the_command_line_and_resumes(runs: Path, tmp_path: Path) -> None:
    # The same run under ddp is the reference: same weights, same batches on each rank, so
    # the losses agree up to float32 reduction order. The text sample needs every rank under
    # fsdp (each forward gathers the weights): a run that sampled on rank 0 alone would hang.
    stdout = (runs / "fsdp.stdout").read_text()
    assert "Training summary" in stdout and "fsdp x2" in stdout
    assert "activation checkpointing: off" in stdout  # the shard plan, printed once
    assert stdout.count("(root: the rest)") == 1
    assert "model state per rank" in stdout
    got = json.loads((runs / "fsdp" / "metrics.json").read_text())
    want = json.loads((runs / "ddp" / "metrics.json").read_text())
    assert got["strategy"] == "fsdp" and got["steps"] == 4 and got["world_size"] == 2
    assert math.isfinite(got["final_loss"])
    assert got["final_loss"] == pytest.approx(want["final_loss"], rel=1e-4)
    assert len(got["sample"]) == 200
    assert [r["rank"] for r in got["memory"]["devices"]] == [0, 1]
    assert any((runs / "fsdp" / "checkpoints").iterdir()), "no checkpoint written"

    # Resumed in a copy: the shared run stays the other test's uninterrupted reference.
    run = tmp_path / "fsdp"
    shutil.copytree(runs / "fsdp", run)
    more = train(
        "--strategy",
        "fsdp",
        "--max-steps",
        "6",
        "--log-every",
        "1",
        "--out",
        str(run),
        "--resume",
        "--hang-timeout",
        "120",
    )
    assert more.returncode == 0, more.stderr[-3000:]
    resumed = json.loads((run / "metrics.json").read_text())
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 6
    rows = list(csv.DictReader((run / "metrics.csv").read_text().splitlines()))
    assert [r["step"] for r in rows if r["loss"]] == ["1", "2", "3", "4", "5", "6"]
    assert [r["step"] for r in rows if r["val_loss"]] == ["4", "6"]  # each stop's validation


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.xdist_group("train-fsdp")
def test_a_killed_fsdp_rank_is_restarted_and_the_run_ends_bitwise_equal(
    runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 is killed at step 3; the launcher restarts both ranks on a fresh port, they
    # resume from the sharded checkpoint of step 2 and finish as the uninterrupted run did.
    from safetensors.torch import load_file

    monkeypatch.setenv("GPUKIT_FAULT", "sigkill:1:3")
    faulted = train(
        "--strategy", "fsdp", *COMMON, "--max-restarts", "2", "--out", str(tmp_path / "b")
    )
    assert faulted.returncode == 0, faulted.stderr[-3000:]
    said = faulted.stdout + faulted.stderr
    assert "restart 1/2 after rank 1 was killed by SIGKILL" in said
    step = Path("checkpoints") / "step-00000004" / "model.safetensors"
    want = load_file(runs / "fsdp" / step)
    got = load_file(tmp_path / "b" / step)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_an_fsdp_runs_config_toml_trains_it_again() -> None:
    # fsdp's options hold tp=1: recorded as --tp 1, the rerun was refused beside --strategy
    # fsdp (the mesh flags are Parallel's).
    from gpukit.cli._parallel_flags import parallel_setting
    from gpukit.train.rerun import rerun_flags

    flags = rerun_flags({"workload": "gpt"}, "32", _strategy(parse("--strategy", "fsdp")).options)
    assert "tp" not in flags
    again = parse(*(f"--{k.replace('_', '-')}={v}" for k, v in flags.items()))
    assert parallel_setting(again) is None
