"""The runner around a launched script: it runs as usual, and its failure is recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpukit.cli.launch as launch_cli

RUNNER = launch_cli.RUNNER


def run(
    script: Path, *args: str, error_file: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        [sys.executable, str(RUNNER), str(script), *args],
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
        env=env,
        cwd=str(cwd or script.parent.parent),
    )


def test_the_script_runs_as_if_started_directly(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "helper.py").write_text("VALUE = 41\n")
    script = folder / "train.py"
    script.write_text(
        "import sys\n"
        "import helper\n"  # its own folder is on sys.path, as with `python train.py`
        "class Box: pass\n"
        "import pickle\n"
        "pickle.dumps(Box())\n"  # classes of __main__ pickle while it runs
        "print(__name__, sys.argv, helper.VALUE + 1, 'torch' in sys.modules)\n"
    )
    done = run(script, "--epochs", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 1) == ["__main__", f"['{script}', '--epochs', '3'] 42 False\n"]


def test_an_error_is_recorded_with_a_fine_clock_and_shown_without_the_runners_frames(
    tmp_path: Path,
) -> None:
    script = tmp_path / "job" / "broken.py"
    script.parent.mkdir()
    script.write_text("def step():\n    raise ValueError('bad shape')\n\nstep()\n")
    error_file = tmp_path / "error.json"
    done = run(Path("job/broken.py"), error_file=error_file, cwd=tmp_path)  # a relative path
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "job/broken.py", line 4' in done.stderr and "ValueError: bad shape" in done.stderr
    assert "runpy" not in done.stderr and "_launched_script" not in done.stderr
    message = json.loads(error_file.read_text())["message"]
    assert message["message"] == "ValueError: bad shape"
    assert int(message["extraInfo"]["time_ns"]) // 10**9 == int(message["extraInfo"]["timestamp"])
    assert "raise ValueError" in message["extraInfo"]["py_callstack"]


def test_exit_codes_pass_through_and_only_failures_are_recorded(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    script = tmp_path / "stop.py"
    script.write_text("import sys\nsys.exit(0)\n")
    assert run(script, error_file=error_file).returncode == 0
    assert not error_file.exists()
    script.write_text("import sys\nsys.exit(3)\n")
    assert run(script, error_file=error_file).returncode == 3
    assert json.loads(error_file.read_text())["message"]["message"] == "SystemExit: 3"


def test_a_syntax_error_is_shown_as_python_shows_it(tmp_path: Path) -> None:
    script = tmp_path / "typo.py"
    script.write_text("def f(:\n    pass\n")
    done = run(script, error_file=tmp_path / "error.json")
    assert done.returncode == 1
    assert "SyntaxError" in done.stderr and "runpy" not in done.stderr


def test_an_unwritable_error_file_does_not_hide_the_scripts_error(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise KeyError('x')\n")
    done = run(script, error_file=tmp_path / "missing-folder" / "error.json")
    assert done.returncode == 1 and "KeyError: 'x'" in done.stderr
