"""gpukit launch: run any torchrun-style script on N processes of this machine, or of several.

Each process gets the variables torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the script runs unchanged; a gpukit Runtime
inside it picks them up by itself. torchrun's spellings of the flags (--nproc-per-node,
--nproc_per_node, --master_addr, ...) work too.

On one machine gpukit starts the processes itself, on 127.0.0.1 and a free port (a fresh one
at every restart):
  - when a process fails, the others are stopped within about 2 s, and the first line names
    the one that failed first (raised, exited or was killed by a signal), with its step and
    phase when it runs a gpukit Runtime, then one line per process;
  - --max-restarts K starts every process again after a failure (a Runtime resumes from its
    newest checkpoint by itself), unless the job failed before its first step or fails the
    same way 3 times in a row; each restart says the steps it redoes, the end what each cost;
  - --hang-timeout S (default 300; 0: never): when a process running a gpukit Runtime makes
    no progress for S seconds, every process writes its stack, the report names the stuck
    one and its line and what the others wait in, and the job is stopped (or restarted);
    the clock starts at each process's first heartbeat, once every process has beaten;
  - --startup-timeout S (default 900, or GPUKIT_STARTUP_TIMEOUT; 0: never): once one process
    has beaten, one that has not beaten S seconds after its start (stuck importing, in the
    rendezvous, loading data) is reported the same way, and the job is stopped;
  - SIGTERM or Ctrl-C, to the command or to any process, reaches every process: a Runtime saves
    and stops; the command exits 143 and restarts nothing. Copies of the signal count once; a
    second Ctrl-C 2 s or more later stops them at once; GPUKIT_STOP_GRACE (default 25 s) is
    how long the processes get before they are killed;
  - the processes never outlive the command, even when it is killed with SIGKILL (Linux).

Several machines go through torchrun: give every node the same --nnodes, --master-addr (node
0's address) and --master-port, and each its own --node-rank. Under Slurm (`srun gpukit launch`,
one per node) and Kubernetes (a PyTorchJob, a JobSet) they are read from the cluster's
variables, and --nproc defaults to Slurm's GPUs per node (docs/clusters.md). Joining waits
at most GPUKIT_RENDEZVOUS_TIMEOUT seconds (default 120). With --max-restarts, the nodes meet through
torchrun's c10d rendezvous with a fresh store for each attempt (node ranks then follow the order
of arrival). There, the failure summary is torchrun's order refined by gpukit's clock, and hangs
are not watched (--hang-timeout applies to one machine).

Example:
    gpukit launch --nproc 2 train.py --epochs 3
    gpukit launch --nproc 4 --max-restarts 3 --hang-timeout 600 train.py
    # two machines, 4 processes each:
    gpukit launch --nproc 4 --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from gpukit import _env
from gpukit.cli._common import add_command
from gpukit.errors import ConfigError, LaunchError
from gpukit.launch import DEFAULT_HANG_TIMEOUT, RUNNER, run_job
from gpukit.launch.clusters import with_cluster_defaults
from gpukit.launch.failures import describe_exit, first_line, is_consequence
from gpukit.launch.spawn import check_port

__all__ = ["RUNNER", "describe_exit", "failure_summary", "register", "run", "torchrun_args"]

NAME = "launch"
DEFAULT_MULTI_NODE_PORT = 29500
LOCAL = "127.0.0.1"


def register(sub: Any) -> None:
    parser = add_command(
        sub, NAME, "run a torchrun-style script on N processes (and M machines)", __doc__
    )
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=None,
        dest="nproc",
        help="processes on this machine (default 1; under Slurm, the node's GPUs)",
    )
    parser.add_argument("--nnodes", type=int, default=None, help="machines in the job (default 1)")
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        dest="node_rank",
        help="this machine's number, 0..nnodes-1",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        dest="master_addr",
        help="address of node 0, with several machines (one machine always uses 127.0.0.1)",
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
        help="after a failure, start every process again, up to K times (default 0)",
    )
    parser.add_argument(
        "--hang-timeout",
        "--hang_timeout",
        type=float,
        default=None,
        dest="hang_timeout",
        metavar="SECONDS",
        help="stop (or restart) the job when a gpukit Runtime's process makes no progress for "
        f"this long, naming it and its line (default {DEFAULT_HANG_TIMEOUT:g}; 0: never)",
    )
    parser.add_argument(
        "--startup-timeout",
        "--startup_timeout",
        type=float,
        default=None,
        dest="startup_timeout",
        metavar="SECONDS",
        help="stop the job when a process has not reached its first heartbeat this long after "
        "its start while another has, naming it and its line (default GPUKIT_STARTUP_TIMEOUT, "
        "else 900; 0: never)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args = with_cluster_defaults(args, f"gpukit {NAME}")  # Slurm's or Kubernetes' node flags
    check(args)
    if args.nnodes > 1:
        port = args.master_port or DEFAULT_MULTI_NODE_PORT
        meeting = (
            f"node {args.node_rank} waited {_env.rendezvous_timeout():g} s at "
            f"{args.master_addr}:{port} for all {args.nnodes} nodes to join, in vain"
        )
        if args.hang_timeout:
            print(
                f"gpukit {NAME}: warning: --hang-timeout applies to one machine; torchrun, which "
                "runs several, does not watch for hangs (a collective times out after the "
                "process group's timeout instead)",
                file=sys.stderr,
            )
        return launch(torchrun_args(args), meeting)
    port = args.master_port
    if port is not None:
        check_port(LOCAL, port)  # this machine hosts the rendezvous: the port must be free
    return run_job(
        [sys.executable, str(RUNNER), args.script, *args.script_args],
        args.nproc,
        max_restarts=args.max_restarts,
        hang_timeout=DEFAULT_HANG_TIMEOUT if args.hang_timeout is None else args.hang_timeout,
        startup_timeout=args.startup_timeout,
        master_port=port,
        name=f"gpukit {NAME}",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse a request that cannot work, before starting anything."""
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
    if args.hang_timeout is not None and not args.hang_timeout >= 0:  # also refuses nan
        raise ConfigError(
            f"--hang-timeout {args.hang_timeout:g}: give seconds, 0 or more (0: never stop a "
            "job for a hang)"
        )
    if args.startup_timeout is not None and not 0 <= args.startup_timeout < math.inf:
        raise ConfigError(
            f"--startup-timeout {args.startup_timeout:g}: give seconds, 0 or more (0: never "
            "stop a job whose process does not start)"
        )
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(
            f"--master-port {args.master_port}: give a TCP port in 1..65535 (or leave it out "
            "to get a free one on one machine)"
        )
    _check_address(args.master_addr, args.nnodes)
    if not Path(args.script).is_file():
        raise ConfigError(f"script {args.script!r} not found: give the path of a Python file")


def _check_address(address: str, nnodes: int) -> None:
    try:
        socket.getaddrinfo(address, None)
    except (OSError, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(
            f"--master-addr {address!r} does not resolve ({reason}): give node 0's IP address "
            "or a host name every node can resolve"
        ) from None
    if nnodes > 1 and address in ("0.0.0.0", "::"):
        print(
            f"gpukit {NAME}: warning: --master-addr {address} listens on every interface but "
            "tells the other nodes nothing they can reach: give node 0's own address",
            file=sys.stderr,
        )


def torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's command line for a job on several machines (``check`` passed)."""
    port = args.master_port or DEFAULT_MULTI_NODE_PORT
    if args.node_rank == 0 and _is_local(args.master_addr):
        check_port(args.master_addr, port)  # node 0 hosts the rendezvous: the port must be free
    bound = math.ceil(_env.rendezvous_timeout())
    if args.max_restarts > 0:
        # torchrun's static rendezvous keeps one store across restarts, on which restarted gloo
        # ranks can read the last attempt's keys and fail to connect; the c10d rendezvous with
        # sharing off gives each attempt a fresh store on a fresh port.
        _env.share_rendezvous_store(False)
        meeting = [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{args.master_addr}:{port}",
            "--rdzv-id",
            f"gpukit-{port}",
            "--rdzv-conf",
            f"join_timeout={bound},is_host={'true' if args.node_rank == 0 else 'false'}",
        ]
    else:
        meeting = [
            "--node-rank",
            str(args.node_rank),
            "--master-addr",
            args.master_addr,
            "--master-port",
            str(port),
            "--rdzv-conf",
            f"timeout={bound}",
        ]
    return [
        "--nnodes",
        str(args.nnodes),
        "--nproc-per-node",
        str(args.nproc),
        *meeting,
        "--max-restarts",
        str(args.max_restarts),
        # Each process runs the script through a small runner that records when and how it
        # failed, so the summary can name the process that failed first.
        str(RUNNER),
        args.script,
        *args.script_args,
    ]


def launch(argv: list[str], meeting: str = "the rendezvous did not complete in time") -> int:
    """Run torchrun in this process; 1 when a worker failed (torchrun has shown its error).
    A rendezvous that does not complete in time is a LaunchError naming ``meeting``."""
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    # torchrun logs an error when it has no file of its own to copy a process's error file
    # to; the summary below says more than that line.
    logging.getLogger("torch.distributed.elastic.multiprocessing.errors.error_handler").setLevel(
        logging.CRITICAL
    )
    store_errors: type[Exception] = getattr(dist, "DistError", RendezvousError)
    try:
        torchrun(argv)
    except ChildFailedError as err:
        print(failure_summary(err.failures), file=sys.stderr)
        return 1
    except (RendezvousError, store_errors) as err:
        said = first_line(str(err)) or type(err).__name__
        raise LaunchError(
            f"{meeting} ({said}): every node must start `gpukit launch` with "
            "the same --nnodes, --master-addr and --master-port, and reach node 0 there (a "
            "firewall?); GPUKIT_RENDEZVOUS_TIMEOUT=SECONDS waits longer"
        ) from None
    return 0


def failure_summary(failures: dict[int, Any]) -> str:
    """Name the process that failed first, then one line per failed process, first to last
    (torchrun's failures; a process that only lost a peer ranks after the others)."""
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
            f"  rank {rank}: exit code {describe_exit(failure.exitcode)}, {first_line(error)}"
        )
    return "\n".join(lines)


def _failed_at(failure: Any) -> tuple[int, int, int]:
    """Sort key: failures of their own, then errors that only say a peer went away, then
    processes torchrun stopped (SIGTERM, nothing recorded); within each, an error recorded
    with its nanosecond time before anything known only to torchrun's whole seconds."""
    recorded = _recorded(failure)
    if not recorded and failure.exitcode == -signal.SIGTERM:
        group = 2
    else:
        group = 1 if is_consequence(str(recorded.get("message", ""))) else 0
    extra = recorded.get("extraInfo", {})
    if "time_ns" in extra:
        return (group, 0, int(extra["time_ns"]))
    return (group, 1, int(failure.timestamp))


def _recorded(failure: Any) -> dict[str, Any]:
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    return message if isinstance(message, dict) else {}


def _is_local(address: str) -> bool:
    return address in ("127.0.0.1", "localhost", "0.0.0.0", "::1")
