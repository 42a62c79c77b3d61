"""`make gpu-check`: it refuses a machine without a GPU, runs its checks with time limits, keeps
their raw output, and writes one PASS/FAIL line per check. On this machine the checks run
with --allow-cpu, where the GPU-only ones must fail, not pass."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpukit.bench import gpu_check
from gpukit.bench.gpu_check import Check, results_folder, run_checks
from gpukit.errors import ConfigError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a GPU-less machine")
def test_without_a_gpu_it_refuses_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "torch sees no CUDA GPU here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.processes
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks that GPU-only checks fail on a CPU")
def test_checks_run_from_the_source_tree_and_keep_their_evidence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--allow-cpu", "--quick", "--only", "doctor,train-32,oom", "--out", str(tmp_path)]
    rc = gpu_check.main(argv)
    folder = next(tmp_path.iterdir())
    summary = json.loads((folder / "summary.json").read_text())
    by_name = {c["name"]: c for c in summary["checks"]}
    assert list(by_name) == ["doctor", "oom", "train-32"]  # the cheap checks first
    assert by_name["doctor"]["passed"] and (folder / "doctor.json").is_file()
    assert by_name["train-32"]["passed"] and "samples/s" in by_name["train-32"]["detail"]
    assert (folder / "train-32" / "metrics.json").is_file()
    # No GPU here: the out-of-memory probe cannot pass, and says why.
    assert not by_name["oom"]["passed"] and "needs one" in by_name["oom"]["detail"]
    assert rc == 1
    for check in summary["checks"]:
        raw = (folder / check["output"]).read_text()
        assert raw.startswith(f"$ {check['command']}\n(exit ")  # every one ran to its end
    table = (folder / "summary.md").read_text()
    assert "| doctor | PASS |" in table and "| oom | FAIL |" in table
    assert "make gpu-check --allow-cpu" in table
    out = capsys.readouterr().out
    assert "PASS  doctor" in out and "FAIL  oom" in out and "2 of 3 checks passed" in out


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
def test_a_check_that_hangs_is_killed_with_the_processes_it_started(tmp_path: Path) -> None:
    started = tmp_path / "child-pid"
    written = started.with_suffix(".tmp")  # renamed once whole
    child = (
        f"import os, pathlib, time; pathlib.Path({str(written)!r}).write_text(str(os.getpid())); "
        f"os.rename({str(written)!r}, {str(started)!r}); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); print('started', flush=True); "
        "time.sleep(60)"
    )
    hang = Check("hang", [sys.executable, "-c", parent], 1.0, lambda rc, out, f: (True, "ran"))
    (outcome,) = run_checks(tmp_path, [hang], lambda line: None)
    assert not outcome.passed and outcome.detail == "did not finish in 1 s"
    # Waited for, not slept on: the child that got to say its pid is gone soon after the kill
    # (one that did not was killed before it could).
    if started.exists():
        pid = int(started.read_text())
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the check's child outlived the timeout"


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, ended and waiting to be reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_checks_past_the_budget_are_failed_not_run(tmp_path: Path) -> None:
    quick = Check("quick", [sys.executable, "-c", "pass"], 60, lambda rc, out, f: (rc == 0, "ok"))
    summaries: list[int] = []
    outcomes = run_checks(
        tmp_path,
        [quick, quick],
        lambda line: None,
        budget_s=0.5,
        after_each=lambda done: summaries.append(len(done)),
    )
    assert [o.detail for o in outcomes] == ["not run: no time left in the budget"] * 2
    assert summaries == [1, 2]  # the summary is rewritten after every check


@pytest.mark.processes
def test_a_judge_that_cannot_read_the_output_fails_the_check_only(tmp_path: Path) -> None:
    def judge(rc: int, out: str, folder: Path) -> tuple[bool, str]:
        raise KeyError("samples_per_s")

    broken = Check("broken", [sys.executable, "-c", "print('{')"], 60, judge)
    fine = Check("fine", [sys.executable, "-c", "pass"], 60, lambda rc, out, f: (rc == 0, "ok"))
    first, second = run_checks(tmp_path, [broken, fine], lambda line: None)
    assert not first.passed and "could not read its result: KeyError" in first.detail
    assert second.passed


@pytest.mark.xdist_group("timing")
@pytest.mark.processes
def test_a_check_that_hangs_is_stopped_at_its_limit(tmp_path: Path) -> None:
    hang = Check(
        "hang",
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"],
        1.0,
        lambda rc, out, folder: (rc == 0, "ran"),
    )
    (outcome,) = run_checks(tmp_path, [hang], lambda line: None)
    assert not outcome.passed and outcome.detail == "did not finish in 1 s"
    assert "started" in (tmp_path / "hang.txt").read_text()


def test_an_unknown_check_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--only 'doctor,nosuch': nosuch not a check"):
        gpu_check.main(["--allow-cpu", "--only", "doctor,nosuch", "--out", str(tmp_path)])


def test_the_results_folder_is_named_by_date_and_gpu() -> None:
    assert results_folder(Path("b"), "NVIDIA H200", "2026-11-23") == Path("b/2026-11-23-h200")
    assert results_folder(Path("b"), "???", "2026-11-23").name == "2026-11-23-gpu"


def test_the_judges_read_what_the_tools_print(tmp_path: Path) -> None:
    tests = "....s\n=== 4 passed, 1 skipped in 3.2s ==="
    assert gpu_check._judge_tests(0, tests, tmp_path) == (True, "4 passed, 1 skipped in 3.2s")
    assert not gpu_check._judge_tests(5, "no tests ran", tmp_path)[0]
    line = json.dumps({"ok": True, "oom_retries": [{}], "global_batch": 256, "micro_batch": 32})
    ok, detail = gpu_check._judge_oom(0, f"noise\n{line}\n", tmp_path)
    assert ok and "1 recovery(ies)" in detail and "micro-batches of 32" in detail
    assert gpu_check._judge_oom(1, "Traceback ...", tmp_path) == (False, "exit 1; no result line")


@pytest.mark.processes
def test_make_gpu_check_runs_the_module_from_the_source_tree() -> None:
    root = Path(gpu_check.__file__).resolve().parents[3]
    done = subprocess.run(
        ["make", "-n", "gpu-check"], cwd=root, capture_output=True, text=True, check=True
    )
    assert "PYTHONPATH=src" in done.stdout and "-m gpukit.bench.gpu_check" in done.stdout


@pytest.mark.gpu
def test_a_real_out_of_memory_is_recovered() -> None:
    from gpukit.bench.oom_probe import probe

    result = probe(torch.device("cuda", 0))
    assert result["ok"], result


def test_speed_is_a_check_of_its_own_judged_by_its_losses(tmp_path: Path) -> None:
    checks = {c.name: c for c in gpu_check.checks(tmp_path, quick=False)}
    assert list(checks).index("speed") < list(checks).index("bench")
    only = checks["bench"].argv[checks["bench"].argv.index("--only") + 1].split(",")
    assert "speed" not in only and "plan" not in only  # speed is not run twice
    stored = Path(__file__).parents[2] / "benchmarks/results/2026-11-29-cpu-speed/speed.json"
    (tmp_path / "speed").mkdir()
    result = json.loads(stored.read_text())
    (tmp_path / "speed" / "speed.json").write_text(json.dumps(result))
    ok, detail = gpu_check._judge_speed(0, "", tmp_path)
    assert ok and "gpt2 train x0.983" in detail and "llama runtime x0.986" in detail
    result["rows"][2]["status"] = "losses differ from nanogpt's"
    (tmp_path / "speed" / "speed.json").write_text(json.dumps(result))
    ok, detail = gpu_check._judge_speed(0, "", tmp_path)
    assert not ok and "losses differ: gpt2 train" in detail
    assert gpu_check._judge_speed(1, "", tmp_path / "none") == (False, "exit 1; no speed.json")
