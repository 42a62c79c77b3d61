"""gpukit launch: run any torchrun-style script on one or many processes and machines.

Delegates to torch.distributed.run (torchrun), so the script sees the usual variables
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and runs unchanged;
a gpukit Runtime inside it picks them up by itself. On one machine a free port of 127.0.0.1 is
chosen; for several machines give every node the same --nnodes, --master-addr and
--master-port, and each its own --node-rank. When a process fails, the others are stopped and
the command exits non-zero after showing that process's error. torchrun's spellings of the
flags (--nproc-per-node, --nproc_per_node, --master_addr, ...) work too.

Example:
    gpukit launch --nproc 2 train.py --epochs 3
    # two machines, 4 processes each:
    gpukit launch --nproc 4 --nnodes 2 --node-rank 0 \
        --master-addr 10.0.0.1 --master-port 29500 train.py
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from gpukit.cli._common import add_command
from gpukit.errors import ConfigError
from gpukit.runtime.launch import check_port, free_port

NAME = "launch"
RUNNER = Path(__file__).resolve().parent.parent / "runtime" / "_launched_script.py"
DEFAULT_MULTI_NODE_PORT = 29500


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "run a torchrun-style script on N processes (and M machines)", __doc__
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        dest="nproc",
        help="processes on this machine (default 1)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        dest="node_rank",
        help="this machine's number, 0..nnodes-1",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        dest="master_addr",
        help="address of node 0 (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        dest="master_port",
        help="port on node 0 (default: a free one on one "
        f"machine, {DEFAULT_MULTI_NODE_PORT} on several)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        dest="max_restarts",
        help="restart the whole group this many times",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return launch(torchrun_args(args))


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """Check the request and turn it into torchrun's command line."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give at least 1 process per machine")
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes {args.nnodes}: give at least 1 machine")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(
            f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} "
            f"for --nnodes {args.nnodes}"
        )
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}: give 0 or more")
    if not Path(args.script).is_file():
        raise ConfigError(f"script {args.script!r} not found: give the path of a Python file")
    port = args.master_port
    if port is None:
        port = free_port(args.master_addr) if args.nnodes == 1 else DEFAULT_MULTI_NODE_PORT
    elif args.node_rank == 0 and _is_local(args.master_addr):
        check_port(args.master_addr, port)  # node 0 hosts the rendezvous: the port must be free
    return [
        "--nnodes",
        str(args.nnodes),
        "--node-rank",
        str(args.node_rank),
        "--nproc-per-node",
        str(args.nproc),
        "--master-addr",
        args.master_addr,
        "--master-port",
        str(port),
        "--max-restarts",
        str(args.max_restarts),
        # Each process runs the script through a small runner that records when and how it
        # failed, so the summary can name the process that failed first.
        str(RUNNER),
        args.script,
        *args.script_args,
    ]


def launch(argv: list[str]) -> int:
    """Run torchrun in this process; 1 when a worker failed (torchrun has shown its error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # torchrun logs an error when it has no file of its own to copy a process's error file
    # to; the summary below says more than that line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").setLevel(
        logging.CRITICAL
    )
    try:
        torchrun(argv)
    except ChildFailedError as err:
        print(failure_summary(err.failures), file=sys.stderr)
        return 1
    return 0


def failure_summary(failures: dict[int, Any]) -> str:
    """Name the process that failed first, then one line per failed process, first to last."""
    order = sorted(failures, key=lambda rank: _failed_at(failures[rank]))
    first = failures[order[0]]
    lines = [
        f"gpukit launch: rank {order[0]} failed with exit code {describe_exit(first.exitcode)} "
        f"({len(failures)} rank(s) failed); its output is above"
    ]
    for rank in order:
        failure = failures[rank]
        error = _recorded(failure).get("message", "no Python error recorded")
        lines.append(
            f"  rank {rank}: exit code {describe_exit(failure.exitcode)}, {_first_line(error)}"
        )
    return "\n".join(lines)


def _failed_at(failure: Any) -> tuple[int, int]:
    """Sort key: an error recorded with its nanosecond time, before anything known only to
    torchrun's whole seconds (a process killed or crashed, or stopped after the first failed)."""
    extra = _recorded(failure).get("extraInfo", {})
    if "time_ns" in extra:
        return (0, int(extra["time_ns"]))
    return (1, int(failure.timestamp))


def _recorded(failure: Any) -> dict[str, Any]:
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, dict) else {}


def _first_line(text: str, width: int = 160) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= width else line[: width - 3] + "..."


def describe_exit(code: int) -> str:
    """``1`` stays ``1``; a negative code is a signal and gets its name: ``-6 (SIGABRT)``.

    A script that raises without destroying its gloo process group can abort in C++ while the
    interpreter shuts down, so the rank that raised may end with SIGABRT rather than 1.
    """
    if code >= 0:
        return str(code)
    try:
        return f"{code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"{code} (signal {-code})"


def _is_local(address: str) -> bool:
    return address in ("127.0.0.1", "localhost", "0.0.0.0", "::1")
