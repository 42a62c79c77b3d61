"""`gpukit train --config FILE`: flags from TOML, the command line over them, and the
config.toml a run writes, which makes the same run again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gpukit.cli.__main__ import main


def _metrics(out: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((out / "metrics.json").read_text())  # type: ignore[no-any-return]


def _weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_a_config_file_gives_the_flags_the_command_line_wins_and_config_toml_reruns(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run.toml"
    run.write_text(
        'workload = "mlp"\nmax_steps = 6\nlr = 0.01\nbatch_size = 32\nlog_every = 2\n'
        f'out = "{tmp_path / "a"}"\nprogress_every = 0\n'
    )
    assert main(["train", "--config", str(run), "--max-steps", "4"]) == 0
    metrics = _metrics(tmp_path / "a")
    config = metrics["config"]
    assert (config["workload"], config["lr"], config["batch_size"]) == ("mlp", 0.01, 32)
    assert config["max_steps"] == 4 and metrics["steps"] == 4  # the command line's
    assert config["runtime"]["log_every"] == 2 and config["epochs"] == 10  # mlp's own
    # config.toml: every flag with the value the run used; it trains the same run again.
    written = (tmp_path / "a" / "config.toml").read_text()
    assert "lr = 0.01\n" in written and "max_steps = 4\n" in written
    assert 'precision = "32"\n' in written and "resume" not in written
    again = tmp_path / "b"
    assert (
        main(["train", "--config", str(tmp_path / "a" / "config.toml"), "--out", str(again)]) == 0
    )
    rerun = _metrics(again)
    assert rerun["final_loss"] == metrics["final_loss"]
    assert rerun["final_val_loss"] == metrics["final_val_loss"]
    for record in (rerun["config"], config):  # all the same but the folder
        del record["out"], record["runtime"]["checkpoints"]
    assert rerun["config"] == config
    first, second = _weights(tmp_path / "a", 4), _weights(again, 4)
    assert all(torch.equal(second[k], v) for k, v in first.items())  # bit for bit


def test_a_switch_in_the_file_resume_true_continues(tmp_path: Path) -> None:
    base = f'workload = "mlp"\nlog_every = 4\nout = "{tmp_path}"\n'
    run = tmp_path / "run.toml"
    run.write_text(base + "max_steps = 4\n")
    assert main(["train", "--config", str(run)]) == 0
    run.write_text(base + "max_steps = 8\nresume = true\n")
    assert main(["train", "--config", str(run)]) == 0
    metrics = _metrics(tmp_path)
    assert metrics["resumed_from_step"] == 4 and metrics["steps"] == 8


def test_an_on_off_flag_is_true_or_false_in_the_file(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(f'workload = "mlp"\nmax_steps = 2\nout = "{tmp_path / "a"}"\n')
    assert main(["train", "--config", str(run), "--async-save", "off"]) == 0
    assert "async_save = false" in (tmp_path / "a" / "config.toml").read_text()
    assert _metrics(tmp_path / "a")["config"]["runtime"]["async_save"] is False
    again = tmp_path / "a" / "config.toml"
    assert main(["train", "--config", str(again), "--out", str(tmp_path / "b")]) == 0
    assert _metrics(tmp_path / "b")["config"]["runtime"]["async_save"] is False
    assert torch.equal(
        _weights(tmp_path / "a", 2)["0.weight"], _weights(tmp_path / "b", 2)["0.weight"]
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_step = 5\n", "line 1: unknown key 'max_step': did you mean 'max_steps'?"),
        ('workload = "mlp"\nbogus = 1\n', "line 2: unknown key 'bogus'"),
        ('max_steps = "5"\n', 'line 1: max_steps = "5" is str: give a whole number'),
        ("lr = true\n", "lr = true is bool: give a number"),
        ("resume = 1\n", "resume = 1 is int: give true or false"),
        ('oom = "maybe"\n', "oom = \"maybe\": give one of 'auto', 'recover', 'raise'"),
        ('async_save = "maybe"\n', "async_save = \"maybe\": 'maybe': use on or off"),
        ("workload = \n", "not valid TOML: "),
        ("[train]\nlr = 1\n", "line 1: [train] is a table"),
        ('config = "other.toml"\n', "unknown key 'config'"),
    ],
)
def test_a_bad_config_file_is_a_one_line_error_naming_the_key(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    if "unknown key" in message:
        assert "workload, " in err and "max_steps" in err  # the keys allowed


def test_a_missing_config_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml: no such file" in capsys.readouterr().err


# Cold: `gpukit train --devices N`'s default start of its ranks, kept under a real test.
@pytest.mark.cold_start
@pytest.mark.processes
def test_a_config_file_reaches_every_rank(tmp_path: Path) -> None:
    run = tmp_path / "run.toml"
    run.write_text(
        'workload = "mlp"\ndevices = 2\nmax_steps = 6\nlr = 0.02\nlog_every = 3\n'
        f'out = "{tmp_path / "out"}"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "gpukit", "train", "--config", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    metrics = _metrics(tmp_path / "out")
    assert metrics["world_size"] == 2 and metrics["strategy"] == "ddp" and metrics["steps"] == 6
    config = metrics["config"]
    assert config["lr"] == 0.02 and config["runtime"]["log_every"] == 3
    assert metrics["final_val_loss"] is not None and metrics["validation"][-1]["step"] == 6
    written = (tmp_path / "out" / "config.toml").read_text()
    assert "devices = 2\n" in written and 'strategy = "ddp"\n' in written
