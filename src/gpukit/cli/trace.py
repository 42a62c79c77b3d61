"""gpukit trace: run a script, or a built-in workload's training loop, under the trace.

Records every copy between host and device (count, bytes, pinned or not, blocking or not) and
every point where the host waits for the device (.item(), .tolist(), bool(t), print(t),
nonzero, boolean-mask indexing, synchronize), each with the source line that caused it and how
often, and counts the ops that ran on each device. Prints the findings ranked by estimated cost,
each with its fix, then the placement summary (ops per device and per module, ops that ran on
the CPU while the model is on a GPU, ops whose inputs mixed devices); --json prints the trace as
data instead, and nothing else: while the traced program runs, what it prints goes to stderr,
so that `gpukit trace --json train.py | jq` works. --out FILE also writes that JSON to FILE.
On a machine without a GPU the host reads that would synchronise on a GPU are reported too,
marked as such.

A script runs in this process as `python script.py args...` would run it (its own arguments
follow its name). --workload NAME instead traces --steps optimizer steps of gpukit train's loop
on one device. --blocking sets CUDA_LAUNCH_BLOCKING=1 first, so that a CUDA error is reported
at the line that caused it, not at a later one; an error is shown after the trace, in words.

--profile DIR also profiles a window of training steps with torch.profiler: --profile-window
WAIT,WARMUP,ACTIVE (default 1,1,3) skips WAIT steps, profiles and drops WARMUP, keeps ACTIVE.
A step is one optimizer step of a gk.Runtime when the script uses one (rt.step that stepped,
rt.train_step), else a step() of the first torch.optim optimizer that steps; the script needs
no change. The window goes to DIR/gpukit_rank{R}.{STEP}.pt.trace.json (Chrome/Perfetto JSON,
read by TensorBoard's profiler plugin, chrome://tracing and ui.perfetto.dev; one file per
rank), its top ops by self time to ...summary.txt and after the report. The profiled steps run
under the trace too: their CPU times include its per-op cost.

Example:
    gpukit trace train.py --epochs 1
    gpukit trace --workload gpt --steps 20
    gpukit trace --json --workload mlp
    gpukit trace --out trace.json train.py --epochs 1
    gpukit trace --blocking train.py
    gpukit trace --profile prof/ train.py
    gpukit trace --profile prof/ --profile-window 2,1,5 --workload gpt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit._util.files import write_atomic
from gpukit.cli._common import add_command, add_json_flag, console, print_json
from gpukit.errors import ConfigError, GpukitError

NAME = "trace"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "find hidden host-device copies and synchronisations, with source lines", __doc__
    )
    add_json_flag(parser)
    parser.add_argument(
        "--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1: errors at the right line"
    )
    parser.add_argument(
        "--workload", help="trace gpukit train's loop on mlp, cnn, gpt, gpt2 or yours"
    )
    parser.add_argument(
        "--steps", type=int, default=20, metavar="N", help="optimizer steps of --workload (20)"
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="also write the JSON to FILE (before the script)"
    )
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="also write a torch.profiler trace to DIR"
    )
    parser.add_argument(
        "--profile-window",
        default=None,
        metavar="W,U,A",
        help="steps to wait, warm up and profile (1,1,3)",
    )
    parser.add_argument("script", nargs="?", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    target = _check(args)
    window = _profile_window(args)
    if args.blocking:
        _env.set_cuda_launch_blocking()
    from gpukit.diagnostics.oplog import log_placement
    from gpukit.diagnostics.profiles import StepProfile
    from gpukit.diagnostics.trace import trace

    failure: BaseException | None = None
    exit_code = 0
    profile = None
    if args.profile is not None:
        wait, warmup, active = window
        profile = StepProfile(args.profile, wait=wait, warmup=warmup, active=active)
    # The placement log only aggregates per module (no record per op): its summary says which
    # ops ran on the CPU while the model is on a GPU, and which ops mixed devices. Entered
    # inside the trace, it rides on the trace's dispatch mode: one pass per op serves both.
    with (
        _stdout_to_stderr() if args.json else contextlib.nullcontext(),
        trace() as t,
        log_placement(level="module") as placement,
        profile if profile is not None else contextlib.nullcontext(),
    ):
        try:
            if isinstance(target, Path):
                exit_code = _run_script(target, args.args)
            else:
                _run_workload(target, args.steps)
        except Exception as err:  # shown after the trace, which is the point of running this
            failure = err
    found = t.to_dict()
    if profile is not None:
        found["profile"] = profile.to_dict()
    if args.out is not None:
        write_atomic(args.out, json.dumps(found, indent=2) + "\n")
    if args.json:
        print_json(found)
    else:
        out = console()
        out.print(t.report(), markup=False, highlight=False)
        out.print(str(placement.summary()), markup=False, highlight=False)
        if profile is not None:
            out.print(profile.report(), markup=False, highlight=False)
    if failure is not None:
        _report_failure(failure)
        return 1
    return exit_code


def _check(args: argparse.Namespace) -> Path | str:
    """The script's path or the workload's name; one of them, never both."""
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give a whole number of at least 1")
    out: Path | None = args.out
    if out is not None and not out.parent.is_dir():
        raise ConfigError(f"--out {out}: the folder {out.parent} does not exist; create it first")
    if args.workload and args.script:
        raise ConfigError(
            f"both --workload {args.workload} and the script {args.script} were given: "
            "trace one of them"
        )
    if args.workload:
        from gpukit.workloads import load_workload

        load_workload(args.workload)  # an unknown name fails here, before anything runs
        return str(args.workload)
    if not args.script:
        raise ConfigError(
            "nothing to trace: give a script (gpukit trace train.py ARGS) or a built-in "
            "workload (gpukit trace --workload gpt)"
        )
    path = Path(args.script)
    if not path.is_file():
        raise ConfigError(f"script {args.script!r} not found (from {Path.cwd()})")
    _check_compiles(path)
    return path


def _profile_window(args: argparse.Namespace) -> tuple[int, int, int]:
    """--profile-window as (wait, warmup, active) (1,1,3 when not given); refused without
    --profile, where it would change nothing."""
    if args.profile_window is not None and args.profile is None:
        raise ConfigError(
            f"--profile-window {args.profile_window} without --profile: the window is of the "
            "profile, and none is taken; add --profile DIR, or drop --profile-window"
        )
    text = "1,1,3" if args.profile_window is None else str(args.profile_window)
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 3 and all(p.isdigit() for p in parts) and int(parts[2]) >= 1:
        wait, warmup, active = map(int, parts)
        if args.profile is not None and args.profile.exists() and not args.profile.is_dir():
            raise ConfigError(f"--profile {args.profile}: that is a file; give a folder")
        return wait, warmup, active
    raise ConfigError(
        f"--profile-window {text!r}: give WAIT,WARMUP,ACTIVE as three whole numbers, ACTIVE at "
        "least 1 (e.g. 1,1,3: skip a step, profile and drop one, keep three)"
    )


def _check_compiles(path: Path) -> None:
    """A script that Python cannot compile fails here, in one line, before the trace starts
    (and before an empty report of a program that never ran)."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as err:  # ValueError: null bytes, on Python < 3.12
        syntax = err if isinstance(err, SyntaxError) else None
        where = f" line {syntax.lineno}" if syntax and syntax.lineno else ""
        text = ((syntax.text if syntax else None) or "").strip()
        shown = f" ({text})" if text else ""
        what = (syntax.msg if syntax else None) or str(err)
        raise ConfigError(
            f"script {str(path)!r}{where} does not compile: {what}{shown}; fix it (python "
            f"-m py_compile {path} shows the same error)"
        ) from None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """What the block writes to stdout goes to stderr: Python's prints, and where stdout is a
    file descriptor, what C code and child processes write to it too."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptors to move
            sys.__stdout__.flush()  # type: ignore[union-attr]
            saved = os.dup(1)
            stack.callback(os.close, saved)
            os.dup2(2, 1)
            stack.callback(os.dup2, saved, 1)
            stack.callback(sys.__stdout__.flush)  # type: ignore[union-attr]
        yield


def _run_script(path: Path, script_args: list[str]) -> int:
    """``python path args...`` in this process: __main__, sys.argv and sys.path[0] as Python
    sets them; the script's sys.exit code becomes ours."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), *script_args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _run_workload(name: str, steps: int) -> None:
    from gpukit.runtime.runtime import Runtime
    from gpukit.train.loop import RUNTIME_DEFAULTS, TrainConfig, fit

    # gpukit train's precision ("auto"), the loop this traces.
    rt = Runtime(seed=0, oom="recover", precision=RUNTIME_DEFAULTS["precision"])
    try:
        # The training steps alone: no validation pass at the end.
        config = TrainConfig(
            workload=name, max_steps=steps, progress=False, sample=False, validate=False
        )
        fit(rt, config)
    finally:
        rt.teardown()


def _report_failure(err: BaseException) -> None:
    """A known error in words, with the line of the script that raised it; anything else with
    its whole traceback, as Python would show it."""
    from gpukit.diagnostics.oom import explain
    from gpukit.diagnostics.oom_message import is_oom
    from gpukit.diagnostics.readable import explain_error

    if is_oom(err):
        readable: object = explain(err)
    else:
        readable = err if isinstance(err, GpukitError) else explain_error(err)
    if readable is None:
        print("gpukit trace: the traced program failed:", file=sys.stderr)
        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
        return
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_user_file(f.filename)]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    print(f"gpukit trace: the traced program failed{where}: {readable}", file=sys.stderr)


def _is_user_file(filename: str) -> bool:
    import torch

    own = (Path(torch.__file__).parent, Path(__file__).parents[1])
    path = Path(filename).resolve()
    return not any(path.is_relative_to(d.resolve()) for d in own)
