"""``gpukit check``: the table and the behaviours it prints, its JSON, and its exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpukit.cli.__main__ import main

SCRIPT = """\
from accelerate import Accelerator
from torch.utils.data import DataLoader

accelerator = Accelerator(cpu=True)
loader = accelerator.prepare(DataLoader(range(8), batch_size=2, shuffle=True))
accelerator.log({"loss": 1.0}, step=3)
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def test_the_table_and_what_will_differ(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(script)]) == 0
    out = capsys.readouterr().out
    assert f"gpukit check {script}" in out
    assert '│    6 │ accelerator.log({"loss": 1.0},' in out
    assert "rt.log_metrics(step=N, **values)" in out and "`" not in out
    assert 'gk.Runtime(devices="cpu")' in out
    assert "What will behave differently:" in out
    assert 'gk.Runtime(data_order="accelerate")' in out


def test_json_for_machines(script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--json", str(script)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["script"] == str(script) and data["libraries"] == ["accelerate"]
    assert [c["line"] for c in data["calls"]] == [4, 4, 5, 6]
    assert data["calls"][2] == {
        "line": 5,
        "library": "accelerate",
        "written": "accelerator.prepare(DataLoader(range(8), batch_size=2, shuffle=True))",
        "call": "accelerator.prepare(model, optimizer, loader, scheduler)",
        "gpukit": "`rt.setup(model, optimizer, loader, scheduler)`",
        "note": "the model first; loaders alone: `rt.setup(loader1, loader2)`",
    }
    assert len(data["behaviours"]) == 2 and all("`" not in b for b in data["behaviours"])


def test_a_script_without_those_calls_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plain.py"
    path.write_text("print('hello')\n")
    assert main(["check", str(path)]) == 0
    assert "no Accelerate, Fabric, DDP or mp.spawn calls found" in capsys.readouterr().out


def test_a_broken_script_exits_2_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "broken.py"
    path.write_text("import torch\nfor x in\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpukit check: error: {path}:2: not valid Python")
    assert "Traceback" not in err


def test_a_missing_script_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "nope.py")]) == 2
    assert "nope.py' is no such file: gpukit check reads a Python script" in capsys.readouterr().err


def test_the_command_line_page_shows_what_it_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = page[page.index("## `gpukit check`") :]
    script = section[section.index("```python\n") + 10 : section.index("```\n", 20)]
    shown = section[section.index("$ gpukit check train.py\n") + 24 :]
    shown = shown[: shown.index("```")]
    (tmp_path / "train.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "train.py"]) == 0
    printed = "\n".join(line.rstrip() for line in capsys.readouterr().out.splitlines())
    assert printed + "\n" == shown
