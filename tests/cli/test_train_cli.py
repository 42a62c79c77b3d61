"""`gpukit train --workload module:function` as a user types it: the `gpukit` console script,
run in the folder that holds the module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit.cli.__main__ import current_folder_first, main

MODULE = """
import torch
from torch import nn


def make():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return nn.Linear(4, 1), torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), nn.MSELoss()
"""

# What pip writes as the `gpukit` entry point: run by path, it starts sys.path with its own
# folder, not the current one (unlike `python -m gpukit` or `python -c`).
CONSOLE_SCRIPT = """import re
import sys
from gpukit.cli.__main__ import main
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(main())
"""


def console_script(tmp_path: Path) -> Path:
    """The installed `gpukit` script beside this Python, else the same script written out."""
    installed = Path(sys.executable).with_name("gpukit")
    if installed.is_file():
        return installed
    made = tmp_path / "bin" / "gpukit"
    made.parent.mkdir()
    made.write_text(CONSOLE_SCRIPT)
    return made


@pytest.mark.processes
def test_the_console_script_finds_a_workload_in_the_current_folder(tmp_path: Path) -> None:
    work = tmp_path / "project"
    work.mkdir()
    (work / "mymod.py").write_text(MODULE)
    script = console_script(tmp_path)
    # Two DDP processes: the module must import in this process (the checks) and in each rank.
    args = ["train", "--workload", "mymod:make", "--devices", "2", "--max-steps", "2"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--out", str(tmp_path / "run")],
        cwd=work,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard only
        check=False,
    )
    assert done.returncode == 0, done.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["workload"] == "mymod:make" and metrics["world_size"] == 2


def test_the_current_folder_replaces_the_scripts_own_folder_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_folder = str(tmp_path / "venv" / "bin")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [os.path.join(bin_folder, "gpukit"), "train"])
    monkeypatch.setattr(sys, "path", [bin_folder, "/some/site-packages"])
    current_folder_first()
    assert sys.path == [str(tmp_path), "/some/site-packages"]  # as `python -m gpukit` has it
    current_folder_first()
    assert sys.path == [str(tmp_path), "/some/site-packages"]  # once only
    monkeypatch.setattr(sys, "path", ["", "/some/site-packages"])  # python -c: already there
    current_folder_first()
    assert sys.path == ["", "/some/site-packages"]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def make(:\n    pass\n", "{file}:1: SyntaxError: invalid syntax"),
        (
            "import torch\nimport no_such_dependency_xyz\n",
            "importing module '{name}' failed (at {file}, line 2) with ModuleNotFoundError: "
            "No module named 'no_such_dependency_xyz': install the package it imports",
        ),
        (
            "x = 1\nraise RuntimeError('settings.toml not found\\nmore')\n",
            "importing module '{name}' failed (at {file}, line 2) with RuntimeError: "
            "settings.toml not found: fix the module",
        ),
        (
            "def build():\n    pass\n",
            "module '{name}' ({file}) has no 'make'; its public functions are build: name one",
        ),
    ],
)
def test_a_workload_module_that_does_not_import_is_a_short_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    source: str,
    expected: str,
) -> None:
    name = f"user_workload_{abs(hash(source)) % 10**8}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", "--workload", f"{name}:make"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit train: error: workload '{name}:make': ")
    assert expected.format(name=name, file=path) in err, err
    # One line; a syntax error adds a second, the offending line itself.
    assert len(err.strip().splitlines()) <= 2 and "Traceback" not in err


def test_a_missing_workload_module_names_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--workload", "not_here_xyz:make"]) == 2
    err = capsys.readouterr().err
    assert f"there is no not_here_xyz.py in the current folder ({tmp_path})" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("lr", ["0", "-0.1", "nan", "inf"])
def test_a_learning_rate_that_cannot_train_is_refused_before_any_step(
    lr: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--workload", "mlp", "--max-steps", "2", "--lr", lr, "--out", str(out)]
    assert main(argv) == 2
    assert f"lr={float(lr)!r}: give a learning rate above 0" in capsys.readouterr().err
    assert not out.exists()


def test_the_learning_rate_given_is_the_one_trained_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    used: list[float] = []
    real = torch.optim.AdamW

    def recording(params, lr):  # type: ignore[no-untyped-def]
        used.append(lr)
        return real(params, lr=lr)

    monkeypatch.setattr(torch.optim, "AdamW", recording)
    out = tmp_path / "run"
    argv = ["train", "--workload", "mlp", "--max-steps", "1", "--lr", "0.25", "--out", str(out)]
    assert main(argv) == 0
    assert used == [0.25]
    assert json.loads((out / "metrics.json").read_text())["config"]["lr"] == 0.25
