"""``gpukit``: the command line. Each subcommand lives in its own module of this package and
provides ``NAME``, ``register(subparsers)`` and ``run(args) -> exit code``.

Exit codes: 0 success; 1 the command ran and found a failure (e.g. a doctor check FAILed);
2 bad input or a failure that would come again (a usage error, or a GpukitError whose
``will_repeat`` says so: a ConfigError, a DeviceError, a file the disk refused), printed in
one or two lines without a traceback; gpukit's launcher restarts no rank that exits 2. Other
GpukitErrors (a collective that failed, NaN gradients) print the same way and exit 1.
Running out of device memory exits 1 with the explanation of ``gpukit.explain`` (the numbers of
the message, and what to try first) instead of torch's bare message; other errors gpukit knows
(tensors on different devices, device-side asserts, cuDNN, missing kernels, an old driver, NCCL
and gloo failures) exit 1 with what happened, why, and the fix. A run stopped by SIGTERM or
SIGINT after saving its checkpoint exits 143 (``gk.Preempted``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from gpukit import __version__
from gpukit.cli import bench, check, devices, doctor, launch, plan, report, top, trace, train
from gpukit.cli._config_file import with_config_file
from gpukit.diagnostics.oom import explain
from gpukit.diagnostics.oom_message import is_oom
from gpukit.diagnostics.readable import explain_error
from gpukit.errors import GpukitError, OutOfMemory, Preempted
from gpukit.launch import _launched_script

COMMANDS = (doctor, devices, train, launch, top, report, trace, bench, plan, check)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpukit",
        description="Deep learning on GPUs made correct, fast and understandable.",
        epilog="Run `gpukit COMMAND --help` for a command's options and an example.",
    )
    parser.add_argument("--version", action="version", version=f"gpukit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # run as the program: the `gpukit` script or `python -m gpukit`
        current_folder_first()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args = with_config_file(parser, args, argv)  # --config FILE: its flags, argv's over them
        return int(args.run(args))
    except OutOfMemory as err:
        print(f"gpukit {args.command}: {err}", file=sys.stderr)
        return 1
    except Preempted:
        # Stopped as asked, after saving: rank 0 said where, once (or gpukit's launcher will,
        # from the record of this exception its runner keeps). It exits 143 on its own.
        raise
    except GpukitError as err:
        # One rank of a job that gpukit's launcher started: it prints this once for all.
        launched = _launched_script
        if not (launched.is_bad_input(err) and launched.report_bad_input(err)):
            if err.will_repeat:
                launched.report_repeating(err)
            print(f"gpukit {args.command}: error: {err}", file=sys.stderr)
        return 2 if err.will_repeat else 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`gpukit doctor --json | head`): silence the final flush.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as err:
        # Known raw errors (out of memory, CUDA, cuDNN, NCCL) are shown in words; others keep
        # their traceback, which is then the most useful thing to show.
        readable = explain(err) if is_oom(err) else explain_error(err)
        if readable is None:
            raise
        print(f"gpukit {args.command}: {readable}", file=sys.stderr)
        return 1


def current_folder_first() -> None:
    """Start sys.path with the current folder, as `python -m gpukit` does, so that
    `--workload mymod:make` finds mymod.py there under both spellings of the command.

    The `gpukit` console script starts it with its own folder instead (the environment's
    bin/), which holds no modules; `python -m` has the current folder there already.
    """
    here = os.getcwd()
    if sys.path and sys.path[0] in ("", here):
        return
    script = sys.argv[0] if sys.argv else ""
    own_folder = os.path.dirname(os.path.abspath(script)) if script else None
    if sys.path and own_folder and os.path.abspath(sys.path[0]) == own_folder:
        sys.path[0] = here
    else:
        sys.path.insert(0, here)


if __name__ == "__main__":
    raise SystemExit(main())
