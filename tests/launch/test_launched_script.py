"""The runner around a launched script: it runs as usual, and its failure is recorded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpukit.cli.launch as launch_cli
from gpukit.launch.failures import read_error

pytestmark = pytest.mark.processes

RUNNER = launch_cli.RUNNER


def run(
    script: Path | str,
    *args: str,
    error_file: Path | None = None,
    cwd: Path | None = None,
    module: bool = False,
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    target = ["-m", str(script)] if module else [str(script)]
    return subprocess.run(
        [sys.executable, str(RUNNER), *target, *args],
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
        env=env,
        cwd=str(cwd or Path(script).parent.parent),
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


def test_an_error_that_would_repeat_is_recorded_as_such(tmp_path: Path) -> None:
    # A class with gpukit's ``will_repeat`` (a ConfigError, a CheckpointWriteError): the
    # runner imports nothing of gpukit, it reads the attribute.
    full = tmp_path / "full.py"
    full.write_text(
        "class CheckpointWriteError(OSError):\n    will_repeat = True\n\n"
        "raise CheckpointWriteError('the disk is full')\n"
    )
    flaky = tmp_path / "flaky.py"
    flaky.write_text("raise OSError('flaky')\n")
    for script, repeats in ((full, True), (flaky, False)):
        error_file = script.with_suffix(".json")
        assert run(script, error_file=error_file).returncode == 1
        recorded = read_error(error_file)
        assert recorded is not None and recorded.will_repeat is repeats


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


def test_an_error_with_an_exit_code_ends_the_process_with_it_in_one_line(tmp_path: Path) -> None:
    script = tmp_path / "stop.py"
    script.write_text(
        "class Preempted(Exception):\n"
        "    exit_code = 143\n"
        "raise Preempted('saved at step 4 in ckpt/; run again to resume')\n"
    )
    error_file = tmp_path / "error.json"
    done = run(script, error_file=error_file)
    assert done.returncode == 143
    assert done.stderr == "Preempted: saved at step 4 in ckpt/; run again to resume\n"
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded == "Preempted: saved at step 4 in ckpt/; run again to resume"


def test_a_module_runs_as_python_m_runs_it(tmp_path: Path) -> None:
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "__init__.py").write_text("")
    (tmp_path / "tool" / "__main__.py").write_text(
        "import os, sys\n"
        "print(__name__, os.path.basename(sys.argv[0]), sys.argv[1:], sys.path[0] == os.getcwd())\n"
        "if sys.argv[1:] == ['fail']:\n"
        "    raise KeyError('boom')\n"
    )
    done = run("tool", "--x", "1", module=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "__main__ __main__.py ['--x', '1'] True\n"
    failed = run("tool", "fail", module=True, cwd=tmp_path, error_file=tmp_path / "e.json")
    assert failed.returncode == 1 and "KeyError: 'boom'" in failed.stderr
    assert "runpy" not in failed.stderr and "_launched_script" not in failed.stderr


@pytest.mark.xdist_group("timing")
def test_sigusr1_writes_every_threads_stack_to_the_job_folder_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, time\n"
        "def waiting():\n"
        "    open(os.path.join(os.environ['GPUKIT_JOB_DIR'], 'ready'), 'w').close()\n"
        "    while not os.path.exists(os.path.join(os.environ['GPUKIT_JOB_DIR'], 'go')):\n"
        "        time.sleep(0.02)\n"
        "waiting()\n"
        "print('went on')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "GPUKIT_JOB_DIR": str(tmp_path), "RANK": "1"}
    env["GPUKIT_ATTEMPT"] = "2"
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(script)], env=env, text=True, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        dump = tmp_path / "stack-1-2.txt"
        while "in waiting" not in dump.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        (tmp_path / "go").touch()
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and output == "went on\n"
    text = dump.read_text()
    assert f'File "{script}", line 5 in waiting' in text
    assert "(most recent call first)" in text
