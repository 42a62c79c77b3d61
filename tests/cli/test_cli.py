"""The command line, in process and as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpukit.cli.__main__ import main
from gpukit.devices import nvml as _nvml
from gpukit.doctor import evaluate
from tests.fakes import cpu_torch, fake_pynvml, h100s, install_pynvml, system


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpukit", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.processes
def test_doctor_json_on_this_machine_exits_zero() -> None:
    done = run_cli("doctor", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["schema_version"] == 1 and data["status"] in ("OK", "WARN")
    assert {c["name"] for c in data["checks"]} >= {"os", "torch", "gpus", "nvidia driver"}


def test_doctor_table_ends_with_counts(capsys) -> None:
    assert main(["doctor", "--no-alloc"]) == 0
    out = capsys.readouterr().out
    assert "gpukit doctor" in out and "│ torch " in out and out.rstrip().endswith(" 0 FAIL")


def test_doctor_exits_one_when_a_check_fails(monkeypatch, capsys) -> None:
    install_pynvml(monkeypatch, fake_pynvml(h100s(1)))
    failing = evaluate(system(), cpu_torch(), _nvml.read())
    monkeypatch.setattr("gpukit.cli.doctor.diagnose", lambda test_allocation: failing)
    assert main(["doctor"]) == 1
    assert "fix: pip install torch" in capsys.readouterr().out


def test_devices_table_and_json(capsys) -> None:
    assert main(["devices"]) == 0
    assert "cpu" in capsys.readouterr().out
    assert main(["devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["device"] == "cpu" and rows[0]["type"] == "cpu"


def test_devices_resolves_a_tensorflow_name(capsys) -> None:
    assert main(["devices", "--json", "/job:localhost/replica:0/task:0/device:CPU:0"]) == 0
    assert json.loads(capsys.readouterr().out)["device"]["device"] == "cpu"


@pytest.mark.processes
@pytest.mark.parametrize("spec", ["cuda:x", "tpu:0", "cpu:3", "-1", "/job:worker/device:GPU:0"])
def test_bad_device_is_a_short_error_with_exit_code_two(spec: str) -> None:
    done = run_cli("devices", spec)
    assert done.returncode == 2
    assert done.stderr.startswith("gpukit devices: error: invalid device")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2


def test_missing_gpu_is_a_short_error_with_exit_code_two(fake_gpus, capsys) -> None:
    fake_gpus(1)
    assert main(["devices", "gpu:4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpukit devices: error: unknown device 'gpu:4': there is no GPU 4")


def test_help_shows_an_example(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    assert "Example:" in capsys.readouterr().out


def test_unknown_subcommand_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["frobnicate"])
    assert exit_info.value.code == 2


def test_a_known_raw_error_is_shown_in_words_with_exit_code_one(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    from gpukit.cli import devices

    def broken(args: object) -> int:
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(devices, "run", broken)
    assert main(["devices"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("gpukit devices: ") and "kernel" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("error", "code"),
    [
        ("ConfigError", 2),  # bad input: the same again
        ("DeviceError", 2),
        ("CheckpointWriteError", 2),  # a disk that refused the checkpoint: the same again
        ("DistributedError", 1),  # a peer went away: a restart may well succeed
        ("NonFiniteError", 1),
    ],
)
def test_an_error_that_would_repeat_exits_two_and_others_one(  # type: ignore[no-untyped-def]
    monkeypatch, capsys, error: str, code: int
) -> None:
    import gpukit.errors
    from gpukit.cli import devices

    def failing(args: object) -> int:
        raise getattr(gpukit.errors, error)("it went wrong")

    monkeypatch.setattr(devices, "run", failing)
    assert main(["devices"]) == code  # gpukit's launcher restarts no rank that exits 2
    assert capsys.readouterr().err == "gpukit devices: error: it went wrong\n"
