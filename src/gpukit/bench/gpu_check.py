"""``make gpu-check``: verify everything that needs an NVIDIA GPU, in one command, and keep the
evidence.

Runs, in this order (the cheap checks first), each in its own process group with a time limit,
all within a budget (``--budget``, default ten minutes), from the source tree
(``PYTHONPATH=src`` works: only torch, numpy, rich, matplotlib and nvidia-ml-py are needed, plus
pytest for the tests):

- ``doctor``: ``gpukit doctor --json``;
- ``oom``: a real out-of-memory error recovered (see :mod:`gpukit.bench.oom_probe`);
- ``train-auto`` and ``train-32``: ``gpukit train --workload gpt`` in ``auto`` and ``32``
  precision, with samples/s and MFU from its metrics.json (its whole run is long enough for
  ``--compile auto`` to compile it with CUDA graphs; ``--quick``'s 30 steps stay eager);
- ``tests``: every test marked ``gpu`` or ``multigpu``;
- ``speed``: ``gpukit bench speed`` (gpt2 and Llama 1B against their plain loops), apart
  from ``bench`` so that its compiling cannot starve the other experiments;
- ``bench``: ``gpukit bench all`` at full sizes (``--quick``: CI sizes), with report.md, but for
  the experiments that run on the CPU alone (``plan``).

Everything goes under ``<out>/<date>-<gpu>/`` (default ``benchmarks/results``): each check's raw
output, ``summary.md`` and ``summary.json`` with one PASS/FAIL line per check, the versions, the
device and the command (rewritten after every check, so a run cut short still leaves one).
Exit status 0 when every check passed.

Example:
    make gpu-check
    PYTHONPATH=src python3 -m gpukit.bench.gpu_check --only doctor,oom
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from gpukit._util.files import make_folder, write_atomic
from gpukit.bench.environment import environment_of
from gpukit.bench.measure import bench_devices
from gpukit.bench.suite import names
from gpukit.errors import ConfigError

SOURCE_ROOT = Path(__file__).resolve().parents[3]  # src/gpukit/bench/ -> the checkout
BUDGET_S = 600.0  # the whole check, on one GPU: ten minutes
# ``plan`` trains with gloo on the CPU alone (54 short runs at full size): it says nothing
# about the GPU, and on an H200's machine it did not finish in the four minutes left to it.
CPU_ONLY_EXPERIMENTS = ("plan",)
# Run as checks of their own, before ``bench`` (which gets the budget that is left): ``speed``
# compiles GPT-2 small and Llama 1B three times each, minutes that must not starve the rest.
OWN_CHECK_EXPERIMENTS = ("speed",)


@dataclass
class Check:
    """One check: the command it runs, its time limit, and how its output is judged."""

    name: str
    argv: list[str]
    timeout_s: float
    judge: Callable[[int, str, Path], tuple[bool, str]]  # (rc, output, folder) -> (ok, detail)


@dataclass
class Outcome:
    name: str
    passed: bool
    seconds: float
    detail: str
    command: str
    output: str  # the file with the raw output, relative to the results folder


def checks(folder: Path, quick: bool) -> list[Check]:
    """The checks, in the order they run, writing what they make under ``folder``."""
    py = sys.executable
    apart = CPU_ONLY_EXPERIMENTS + OWN_CHECK_EXPERIMENTS
    gpu_experiments = ",".join(n for n in names() if n not in apart)
    bench = [py, "-m", "gpukit", "bench", "all", "--only", gpu_experiments]
    bench += ["--out", str(folder / "bench")]
    tests = [py, "-m", "pytest", "-m", "gpu or multigpu", "-q", "-rs", "-p", "no:cacheprovider"]
    train = [py, "-m", "gpukit", "train", "--workload", "gpt", "--progress-every", "10"]
    return [  # the cheap checks first, so that a slow one cannot starve them of time
        Check("doctor", [py, "-m", "gpukit", "doctor", "--json"], 120, _judge_doctor),
        Check("oom", [py, "-m", "gpukit.bench.oom_probe"], 180, _judge_oom),
        *(
            Check(
                f"train-{p}",
                [*train, "--precision", p, "--out", str(folder / f"train-{p}")]
                + (["--max-steps", "30"] if quick else []),
                180,
                _judge_train(f"train-{p}"),
            )
            for p in ("auto", "32")
        ),
        Check("tests", [*tests, str(SOURCE_ROOT / "tests")], 300, _judge_tests),  # a checkout's
        Check(
            "speed",
            [py, "-m", "gpukit", "bench", "speed", "--out", str(folder / "speed")]
            + (["--quick"] if quick else []),
            360,
            _judge_speed,
        ),
        Check("bench", bench + (["--quick"] if quick else []), 480, _judge_rc("report.md")),
    ]


def run_checks(
    folder: Path,
    selected: Sequence[Check],
    echo: Callable[[str], None],
    budget_s: float = BUDGET_S,
    after_each: Callable[[list[Outcome]], None] = lambda outcomes: None,
) -> list[Outcome]:
    """Run ``selected`` one after the other within ``budget_s`` seconds in all: each check
    gets its own limit or what is left, whichever is less, and one that fails or hangs does
    not stop the others. A check stopped at its limit is killed with every process it
    started (DDP workers, test subprocesses), so none holds the GPU for the next check."""
    outcomes: list[Outcome] = []
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    deadline = time.monotonic() + budget_s
    for check in selected:
        log = folder / f"{check.name}.txt"
        limit = min(check.timeout_s, deadline - time.monotonic())
        start = time.perf_counter()
        rc: int | None
        if limit < 1:
            rc, output, passed, detail = None, "", False, "not run: no time left in the budget"
        else:
            rc, stdout, output = _run(check.argv, env, limit)
            if rc is None:
                passed, detail = False, f"did not finish in {limit:.0f} s"
            else:
                try:
                    passed, detail = check.judge(rc, stdout, folder)
                except Exception as err:  # a surprising output must not lose the summary
                    passed, detail = False, f"could not read its result: {err!r}"
        seconds = time.perf_counter() - start
        status = "not finished" if rc is None else f"exit {rc}"
        write_atomic(log, f"$ {shlex.join(check.argv)}\n({status}, {seconds:.1f} s)\n\n{output}")
        outcome = Outcome(check.name, passed, seconds, detail, shlex.join(check.argv), log.name)
        echo(_line(outcome))
        outcomes.append(outcome)
        after_each(outcomes)
    return outcomes


def _run(argv: list[str], env: dict[str, str], limit: float) -> tuple[int | None, str, str]:
    """(exit status or None when stopped at ``limit``, stdout, stdout + stderr)."""
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=SOURCE_ROOT,
        start_new_session=True,  # its own process group: a timeout kills its children too
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit)
        return proc.returncode, stdout, stdout + stderr
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, stdout, stdout + stderr


def results_folder(base: Path, device_name: str, date: str | None = None) -> Path:
    """``base/<date>-<gpu>``: e.g. ``2026-11-23-h100-80gb-hbm3``.

    >>> results_folder(Path("r"), "NVIDIA H100 80GB HBM3", "2026-11-23").name
    '2026-11-23-h100-80gb-hbm3'
    """
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().replace("nvidia", "")).strip("-")
    day = date or datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return base / f"{day}-{slug or 'gpu'}"


def write_summary(folder: Path, outcomes: Sequence[Outcome], env: dict[str, Any]) -> None:
    """``summary.json`` and ``summary.md``: one PASS/FAIL line per check, and the machine."""
    passed = sum(o.passed for o in outcomes)
    data = {"passed": passed, "checks": [asdict(o) for o in outcomes], "environment": env}
    write_atomic(folder / "summary.json", json.dumps(data, indent=2) + "\n")
    gpus = [d["name"] for d in env.get("devices", []) if d["device"].startswith("cuda")]
    lines = [
        "# gpukit GPU check",
        "",
        f"- date: {env['date']}",
        f"- device: {', '.join(gpus) or 'no GPU'}",
        f"- torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}, "
        f"gpukit {env['gpukit']}, {env['cpu']} ({env['cpu_cores']} cores)",
        f"- command: `{env['command']}`",
        f"- {passed} of {len(outcomes)} checks passed",
        "",
        "| check | result | seconds | detail | raw output |",
        "| --- | --- | --- | --- | --- |",
    ]
    for o in outcomes:
        result = "PASS" if o.passed else "FAIL"
        detail = o.detail.replace("|", "\\|")
        lines.append(
            f"| {o.name} | {result} | {o.seconds:.1f} | {detail} | [{o.output}]({o.output}) |"
        )
    write_atomic(folder / "summary.md", "\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make gpu-check", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=SOURCE_ROOT / "benchmarks" / "results")
    parser.add_argument("--quick", action="store_true", help="CI-sized bench and training")
    parser.add_argument("--only", help="comma-separated checks (default: all)")
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        metavar="SECONDS",
        help=f"time for all the checks together (default {BUDGET_S:.0f})",
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run without a GPU (to try the checks themselves; a GPU check then proves nothing)",
    )
    args = parser.parse_args(argv)
    devices = bench_devices()
    gpus = [d for d in devices if d.type == "cuda"]
    if not gpus and not args.allow_cpu:
        print(
            "make gpu-check: torch sees no CUDA GPU here (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch (`gpukit doctor` says what "
            "is missing)",
            file=sys.stderr,
        )
        return 2
    name = torch.cuda.get_device_name(gpus[0]) if gpus else "cpu"
    folder = results_folder(args.out, name)
    make_folder(folder)
    every = checks(folder, args.quick)
    selected = _select(every, args.only)
    given = list(sys.argv[1:] if argv is None else argv)
    env = environment_of(devices, command=" ".join(["make gpu-check", *map(shlex.quote, given)]))
    print(f"gpukit GPU check on {name}: {len(selected)} checks, results in {folder}")
    if not args.budget > 0:
        raise ConfigError(f"--budget {args.budget}: give a positive number of seconds")
    outcomes = run_checks(
        folder, selected, print, args.budget, lambda done: write_summary(folder, done, env)
    )
    passed = sum(o.passed for o in outcomes)
    print(f"{passed} of {len(outcomes)} checks passed; summary: {folder / 'summary.md'}")
    return 0 if passed == len(outcomes) else 1


def _select(every: list[Check], only: str | None) -> list[Check]:
    if only is None:
        return every
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = [c.name for c in every]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(
            f"--only {only!r}: {', '.join(unknown) or 'no names'} not a check; give "
            f"comma-separated names from {', '.join(known)}"
        )
    return [c for c in every if c.name in names]


def _line(o: Outcome) -> str:
    return f"{'PASS' if o.passed else 'FAIL'}  {o.name:<11} {o.seconds:6.1f} s  {o.detail}"


def _pythonpath() -> str:
    """The source tree first, so that the checks test this checkout, not an installed copy."""
    src = str(SOURCE_ROOT / "src")
    rest = os.environ.get("PYTHONPATH", "")
    return src + (os.pathsep + rest if rest else "")


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def _judge_doctor(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        return False, f"exit {rc}; no JSON report"
    write_atomic(folder / "doctor.json", json.dumps(report, indent=2) + "\n")
    return rc == 0, f"status {report.get('status', '?')} (exit {rc})"


def _judge_tests(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
    tail = [line for line in stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped)", line)]
    summary = tail[-1].strip("= ") if tail else "no test summary"
    # Exit 5: no test was collected, which means the marks or the path are wrong: a failure.
    return rc == 0, summary + ("" if rc == 0 else f" (exit {rc})")


def _judge_rc(expected: str) -> Callable[[int, str, Path], tuple[bool, str]]:
    def judge(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
        report = folder / "bench" / expected
        ran = re.search(r"(\d+) of (\d+) experiments ran", stdout)
        detail = ran.group(0) if ran else "no summary line"
        return rc == 0 and report.is_file(), f"{detail} (exit {rc})"

    return judge


def _judge_speed(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
    """``bench speed``: every loop's ratio to its model's plain loop and its MFU; passed when
    it ran and every loop's first losses agree with the plain loop's."""
    path = folder / "speed" / "speed.json"
    if rc != 0 or not path.is_file():
        return False, f"exit {rc}" + ("" if path.is_file() else "; no speed.json")
    rows = json.loads(path.read_text())["rows"]
    shown = [
        f"{r['model']} {r['variant']} x{r['ratio']:.3f}"
        + (f" MFU {r['mfu']:.1%}" if r.get("mfu") is not None else "")
        for r in rows
    ]
    differ = [f"{r['model']} {r['variant']}" for r in rows if r["status"] != "ok"]
    detail = "; ".join(shown) + (f"; losses differ: {', '.join(differ)}" if differ else "")
    return not differ, detail


def _judge_train(name: str) -> Callable[[int, str, Path], tuple[bool, str]]:
    def judge(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
        path = folder / name / "metrics.json"
        if rc != 0 or not path.is_file():
            return False, f"exit {rc}" + ("" if path.is_file() else "; no metrics.json")
        m = json.loads(path.read_text())
        mfu = f"{m['mfu']:.2%}" if m.get("mfu") is not None else "-"  # a tiny model: 0.02%
        return True, (
            f"{m['samples_per_s']:.0f} samples/s, MFU {mfu}, final loss {m['final_loss']:.3f}, "
            f"{m['precision']} on {', '.join(m['devices'])}"
        )

    return judge


def _judge_oom(rc: int, stdout: str, folder: Path) -> tuple[bool, str]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        return False, f"exit {rc}; no result line"
    result = json.loads(lines[-1])
    if "error" in result:
        return False, result["error"]
    retries = result.get("oom_retries") or []
    return rc == 0 and bool(result.get("ok")), (
        f"{len(retries)} recovery(ies); global batch {result.get('global_batch')} ran as "
        f"micro-batches of {result.get('micro_batch')}; final loss {result.get('final_loss')}"
    )


if __name__ == "__main__":
    sys.exit(main())
