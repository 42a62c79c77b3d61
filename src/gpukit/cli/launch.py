"""gpukit launch: run any torchrun-style script on N processes of this machine, or of several.

Each process gets the variables torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the script runs unchanged; a gpukit Runtime
inside it picks them up by itself. torchrun's spellings of the flags (--nproc-per-node,
--nproc_per_node, --master_addr, ...) work too.

gpukit starts the processes itself, on every machine, and watches them:
  - when a process fails, the others are stopped within about 2 s, and the first line names
    the one that failed first (raised, exited or was killed by a signal), with its step and
    phase when it runs a gpukit Runtime, then one line per process;
  - --max-restarts K starts every process again after a failure (a Runtime resumes from its
    newest checkpoint by itself), at any moment of a job that has trained (start-up and
    saves included), unless the job never took a step or 3 failed attempts in a row saved
    no new checkpoint; each restart says the rule, the steps it redoes, the end what each cost;
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
  - --straggler-factor X --straggler-steps N (default 1.2 and 20; 0 steps: never): a process
    whose own time per step (outside the calls where processes meet) stays over X times the
    median process's for N steps is named in one line, with the phase it loses its time in;
    the job's folder keeps live.json (every process's figures, for `gpukit top`) and
    events.jsonl;
  - the processes never outlive the command, even when it is killed with SIGKILL (Linux).

One machine uses 127.0.0.1 and a free port (a fresh one at every restart). Several machines:
give every node the same --nnodes, --nproc, --master-addr (node 0's address) and
--master-port, and each its own --node-rank; node 0 hosts the meeting point there. Under Slurm
(`srun gpukit launch`, one per node) and Kubernetes (a PyTorchJob, a JobSet) they are read from
the cluster's variables, and --nproc defaults to Slurm's GPUs per node (docs/clusters.md). The
nodes' launchers meet at every attempt (torch's c10d rendezvous), waiting at most
GPUKIT_RENDEZVOUS_TIMEOUT seconds (default 120); the rules above hold across all of them: a
failure, a hang or a stop on one node stops every node, every node names the same first failure
and takes the same decision to restart. --nnodes MIN:MAX lets nodes join between attempts: the
running attempt saves and the job goes on with them.

Example:
    gpukit launch --nproc 2 train.py --epochs 3
    gpukit launch --nproc 4 --max-restarts 3 --hang-timeout 600 train.py
    # two machines, 4 processes each:
    gpukit launch --nproc 4 --nnodes 2 --node-rank 0 \\
        --master-addr 10.0.0.1 --master-port 29500 train.py
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
from pathlib import Path
from typing import Any

from gpukit.cli._common import add_command
from gpukit.errors import ConfigError
from gpukit.launch import DEFAULT_HANG_TIMEOUT, RUNNER, Nodes, run_job
from gpukit.launch.clusters import with_cluster_defaults
from gpukit.launch.failures import describe_exit
from gpukit.launch.job import straggler_settings
from gpukit.launch.ports import check_port
from gpukit.launch.stragglers import DEFAULT_FACTOR, DEFAULT_STEPS

__all__ = ["RUNNER", "describe_exit", "nodes", "register", "run"]

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
    parser.add_argument(
        "--nnodes",
        default=None,
        help="machines in the job (default 1), or MIN:MAX to let machines join between attempts",
    )
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
    parser.add_argument(
        "--straggler-factor",
        default=str(DEFAULT_FACTOR),
        dest="straggler_factor",
        metavar="X",
        help="name a straggler: a process whose own time per step is over X times the "
        f"median process's (default {DEFAULT_FACTOR:g})",
    )
    parser.add_argument(
        "--straggler-steps",
        default=str(DEFAULT_STEPS),
        dest="straggler_steps",
        metavar="N",
        help="how many of its steps in a row a process stays that slow before it is named "
        f"(default {DEFAULT_STEPS}; 0: never name one)",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    args = _with_cluster_defaults(args)
    check(args)
    several = nodes(args)
    port = args.master_port
    if several is None and port is not None:
        check_port(LOCAL, port)  # this machine hosts the rendezvous: the port must be free
    if several is not None and args.node_rank == 0 and _is_local(args.master_addr):
        check_port(args.master_addr, several.master_port)  # node 0 hosts the meeting point
    return run_job(
        [sys.executable, str(RUNNER), args.script, *args.script_args],
        args.nproc,
        max_restarts=args.max_restarts,
        hang_timeout=DEFAULT_HANG_TIMEOUT if args.hang_timeout is None else args.hang_timeout,
        startup_timeout=args.startup_timeout,
        master_port=port,
        name=f"gpukit {NAME}",
        nodes=several,
        straggler_factor=args.straggler_factor,
        straggler_steps=args.straggler_steps,
    )


def _with_cluster_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Slurm's or Kubernetes' node flags for those left out. The cluster counts its nodes as a
    number: a range given here is checked against it by its MAX, and kept."""
    given = args.nnodes
    if given is None:
        return with_cluster_defaults(args, f"gpukit {NAME}")
    low, high = _nnodes(str(given))
    args.nnodes = high
    args = with_cluster_defaults(args, f"gpukit {NAME}")
    args.nnodes = high if low == high else given
    return args


def nodes(args: argparse.Namespace) -> Nodes | None:
    """The job's machines as ``--nnodes`` gives them (None: this one alone)."""
    low, high = _nnodes(str(args.nnodes))
    if high == 1:
        return None
    port = args.master_port or DEFAULT_MULTI_NODE_PORT
    return Nodes(low, high, args.node_rank, args.master_addr, port)


def _nnodes(text: str) -> tuple[int, int]:
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high:
        raise ConfigError(
            f"--nnodes {text}: give the number of machines (1 or more), or MIN:MAX with "
            "1 <= MIN <= MAX to let machines join between attempts"
        )
    return low, high


def check(args: argparse.Namespace) -> None:
    """Refuse a request that cannot work, before starting anything."""
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: give at least 1 process per machine")
    high = _nnodes(str(args.nnodes))[1]
    if not 0 <= args.node_rank < high:
        raise ConfigError(
            f"--node-rank {args.node_rank} is outside 0..{high - 1} for --nnodes {args.nnodes}"
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
    args.straggler_factor, args.straggler_steps = straggler_settings(
        args.straggler_factor, args.straggler_steps, flags=True
    )
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(
            f"--master-port {args.master_port}: give a TCP port in 1..65535 (or leave it out "
            "to get a free one on one machine)"
        )
    _check_address(args.master_addr, high)
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


def _is_local(address: str) -> bool:
    return address in ("127.0.0.1", "localhost", "0.0.0.0", "::1")
