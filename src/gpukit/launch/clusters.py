"""Which cluster a launcher runs in, and what it says about the job's nodes.

Under Slurm and Kubernetes ``gpukit launch`` needs no node flags: :func:`detect` reads the node
count, this node's rank, node 0's address and port from the variables those systems set, and
:func:`with_cluster_defaults` fills in the flags left out. A flag given wins; ``--nnodes`` or
``--node-rank`` that contradicts the cluster is refused (nodes that disagree on their count or
ranks wait for each other forever, or train two nodes as one). ``--master-addr`` and
``--master-port`` override the cluster's (another interface of node 0, a port of one's choice).

Slurm: ``srun gpukit launch ...`` in an allocation, one launcher per node.

- nodes: ``SLURM_STEP_NUM_NODES`` (the step's), else ``SLURM_NNODES``, else
  ``SLURM_JOB_NUM_NODES``; this node: ``SLURM_NODEID`` (its place among the step's nodes);
- node 0: the first host of ``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``, else
  ``SLURM_NODELIST``, read by ``gpukit.launch.hostlists`` (``scontrol`` may be missing);
- port: ``MASTER_PORT`` when set, else ``20000 + SLURM_JOB_ID % 10000``: every node of a job
  computes the same, two jobs sharing a node differ, and it lies between the privileged ports
  and Linux's ephemeral ones (32768 and up);
- processes per node, when ``--nproc`` is left out: ``SLURM_GPUS_ON_NODE``, else
  ``SLURM_GPUS_PER_NODE``, else 1.

Refused: several launchers per node (more tasks than nodes), and a batch script that runs
``gpukit launch`` on several nodes without ``srun`` (no ``SLURM_STEP_ID``: only the first node
would run it).

Kubernetes (``KUBERNETES_SERVICE_HOST`` is set), one launcher per pod:

- ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``,
  ``PET_NPROC_PER_NODE``: torchrun's flags as variables (Kubeflow Trainer sets them all;
  a PyTorchJob sets ``PET_NNODES`` and ``PET_NPROC_PER_NODE``, and for an elastic one
  ``PET_RDZV_ENDPOINT``, read as node 0's address and port);
- ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``: a PyTorchJob with a Master
  replica gives them to each pod. At this level they count pods (the master is 0, worker i is
  i + 1), not processes: the launcher gives each of its processes their own;
- ``JOB_COMPLETION_INDEX`` (an Indexed Job, a JobSet): this pod's rank when nothing else says.

>>> detect({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2",
...         "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[01-02]"}).master_addr
'node01'
>>> detect({}) is None
True
"""

from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpukit import _env
from gpukit.errors import ConfigError
from gpukit.launch.hostlists import first_host

__all__ = ["ClusterNodes", "detect", "resolve", "slurm_port", "summary", "with_cluster_defaults"]

FIELDS = ("nnodes", "node_rank", "master_addr", "master_port", "nproc")
FLAGS = {name: "--" + name.replace("_", "-") for name in FIELDS}
DEFAULTS: dict[str, Any] = {"nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "nproc": 1}
PORT_BASE, PORT_SPAN = 20000, 10000
# The step's own values first: `srun --nodes=1` in a 2-node allocation runs on one node.
SLURM_NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
SLURM_NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
ONE_PER_NODE = (
    "start one launcher per node, which starts the processes: `srun --ntasks-per-node=1 "
    "gpukit launch --nproc N ...` (N processes per node, e.g. its GPU count)"
)


@dataclass(frozen=True)
class ClusterNodes:
    """What a cluster says about the job's nodes: None where it says nothing, and in
    ``sources`` the variable each value came from (``{"nnodes": "SLURM_NNODES", ...}``)."""

    system: str  # "Slurm" or "Kubernetes"
    job: str  # how the line names the job: "Slurm job 1234"
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nproc: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict)


def detect(env: Mapping[str, str] | None = None) -> ClusterNodes | None:
    """What the cluster this process runs in says about its job's nodes, or None outside a
    cluster. ``env`` defaults to the cluster's variables of this process's environment.
    A launch of the wrong shape is a ConfigError saying how to start it."""
    env = _env.cluster_variables() if env is None else env
    env = {name: value.strip() for name, value in env.items() if value.strip()}
    if "SLURM_JOB_ID" in env or "SLURM_JOBID" in env:
        return _slurm(env)
    if "KUBERNETES_SERVICE_HOST" in env:
        return _kubernetes(env)
    return None


def _slurm(env: dict[str, str]) -> ClusterNodes:
    job_var, job = _pick(env, "SLURM_JOB_ID", "SLURM_JOBID")
    assert job_var is not None and job is not None
    sources: dict[str, str] = {}
    nnodes = _read(env, sources, "nnodes", *SLURM_NODE_COUNTS, low=1) or 1
    if "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        _one_task_per_node(env, nnodes, sources.get("nnodes", "SLURM_NNODES"))
    elif nnodes > 1:
        raise ConfigError(
            f"{sources['nnodes']}={nnodes} but no SLURM_STEP_ID: `gpukit launch` runs in the "
            f"batch script of Slurm job {job}, on its first node only, and would wait forever "
            f"for the other {nnodes - 1}. Start it with srun, one per node: `srun "
            "--ntasks-per-node=1 gpukit launch ...` (or `srun --nodes=1 ...` for one node)"
        )
    node_rank = _read(env, sources, "node_rank", "SLURM_NODEID", low=0)
    if node_rank is None and nnodes > 1:
        raise ConfigError(
            f"{sources['nnodes']}={nnodes} but SLURM_NODEID is unset: nothing says which node "
            "this is. Start `gpukit launch` with srun, one per node"
        )
    list_var, hosts = _pick(env, *SLURM_NODE_LISTS)
    master_addr = None
    if list_var is not None and hosts is not None:
        master_addr = first_host(hosts, list_var)
        sources["master_addr"] = list_var
    master_port = _read(env, sources, "master_port", "MASTER_PORT", low=1, high=65535)
    if master_port is None:
        master_port = slurm_port(job)
        sources["master_port"] = job_var
    nproc = _gpus(env, sources)
    return _checked(
        ClusterNodes(
            "Slurm", f"Slurm job {job}", nnodes, node_rank, master_addr, master_port, nproc, sources
        )
    )


def _one_task_per_node(env: dict[str, str], nnodes: int, nodes_var: str) -> None:
    """Refuse a step that runs several launchers on a node: each would start its own processes
    and form a job of its own with the same node rank."""
    # The step's own count when srun gave one (an sbatch --ntasks-per-node lingers in the
    # step's environment even where srun --ntasks-per-node=1 overrode it).
    tasks_var, tasks = _pick(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if tasks_var is not None and tasks is not None:
        count = _number(tasks_var, tasks, 1)
        if count > nnodes:
            raise ConfigError(
                f"{tasks_var}={count} on {nodes_var}={nnodes}: Slurm started {count} copies of "
                f"`gpukit launch`, more than one per node; {ONE_PER_NODE}"
            )
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    several = per_node is not None and _number("SLURM_NTASKS_PER_NODE", per_node, 1) > 1
    if tasks_var != "SLURM_STEP_NUM_TASKS" and several:
        raise ConfigError(
            f"SLURM_NTASKS_PER_NODE={per_node}: Slurm starts {per_node} copies of "
            f"`gpukit launch` on each node; {ONE_PER_NODE}"
        )


def slurm_port(job: str) -> int:
    """The port node 0 listens on for Slurm job ``job``: ``20000 + job % 10000`` (a job id
    that is not a number is hashed with CRC-32, the same on every node).

    >>> slurm_port("1234"), slurm_port("99991234")
    (21234, 21234)
    """
    number = int(job) if job.isascii() and job.isdigit() else zlib.crc32(job.encode())
    return PORT_BASE + number % PORT_SPAN


def _gpus(env: dict[str, str], sources: dict[str, str]) -> int | None:
    """GPUs per node that Slurm gave the job: ``SLURM_GPUS_ON_NODE`` (a count), else
    ``SLURM_GPUS_PER_NODE`` (``8``, ``a100:8``, or ``a100:4,v100:2``); None for none. A
    count that cannot be read is named in ``sources`` without a value (refused unless
    ``--nproc`` is given)."""
    name, spec = _pick(env, "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
    if name is None or spec is None:
        return None
    counts = [part.rpartition(":")[2] for part in spec.split(",")]
    sources["nproc"] = f"{name}={spec!r}"
    if not all(c.isascii() and c.isdigit() and len(c) <= 6 for c in counts):
        return None
    if not sum(map(int, counts)):
        del sources["nproc"]  # no GPUs: --nproc or 1
        return None
    sources["nproc"] = name
    return sum(map(int, counts))


def _kubernetes(env: dict[str, str]) -> ClusterNodes | None:
    sources: dict[str, str] = {}
    nnodes = None
    if "PET_NNODES" in env:
        nnodes = _node_count(env["PET_NNODES"])
        sources["nnodes"] = "PET_NNODES"
    world = _read(env, {}, "", "WORLD_SIZE", low=1)
    if nnodes is None and world is not None:
        nnodes = world
        sources["nnodes"] = "WORLD_SIZE"
    # RANK numbers pods when WORLD_SIZE counts them (a PyTorchJob's), not when it counts
    # processes (then PET_NODE_RANK says which pod this is).
    ranks = ["PET_NODE_RANK", "RANK", "JOB_COMPLETION_INDEX"]
    if world is None or world != nnodes:
        ranks.remove("RANK")
    node_rank = _read(env, sources, "node_rank", *ranks, low=0)
    master_addr = _text(env, sources, "master_addr", "PET_MASTER_ADDR", "MASTER_ADDR")
    master_port = _read(
        env, sources, "master_port", "PET_MASTER_PORT", "MASTER_PORT", low=1, high=65535
    )
    endpoint = env.get("PET_RDZV_ENDPOINT")
    if endpoint and (master_addr is None or master_port is None):
        host, _, port = endpoint.rpartition(":")
        if master_addr is None and host:
            master_addr = host
            sources["master_addr"] = "PET_RDZV_ENDPOINT"
        if master_port is None:
            master_port = _number("PET_RDZV_ENDPOINT", port, 1, 65535)
            sources["master_port"] = "PET_RDZV_ENDPOINT"
    nproc = _nproc_per_node(env, sources)
    if not sources:
        return None  # a pod that is no part of a training job: one machine
    return _checked(
        ClusterNodes(
            "Kubernetes", "Kubernetes", nnodes, node_rank, master_addr, master_port, nproc, sources
        )
    )


def _node_count(text: str) -> int:
    """``PET_NNODES``: ``N``, or ``MIN:MAX`` for an elastic job (gpukit runs MIN = MAX only)."""
    low, _, high = text.partition(":")
    count = _number("PET_NNODES", low, 1)
    if high and _number("PET_NNODES", high, 1) != count:
        raise ConfigError(
            f"PET_NNODES={text!r} asks for between {low} and {high} nodes: gpukit launch runs a "
            "fixed number of nodes. Set the job's minReplicas and maxReplicas to the same count"
        )
    return count


def _nproc_per_node(env: dict[str, str], sources: dict[str, str]) -> int | None:
    """``PET_NPROC_PER_NODE``: a count, or ``gpu``/``auto`` for this machine's GPU count."""
    text = env.get("PET_NPROC_PER_NODE")
    if text is None:
        return None
    if text in ("gpu", "auto"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < 1:
            return None  # no GPU to count: --nproc or 1
        sources["nproc"] = "PET_NPROC_PER_NODE"
        return count
    if text == "cpu":
        return None
    return _read(env, sources, "nproc", "PET_NPROC_PER_NODE", low=1)


def _checked(found: ClusterNodes) -> ClusterNodes:
    nnodes, node_rank = found.nnodes, found.node_rank
    if nnodes is not None and node_rank is not None and node_rank >= nnodes:
        rank, count = found.sources["node_rank"], found.sources["nnodes"]
        raise ConfigError(
            f"{rank}={node_rank} is outside 0..{nnodes - 1} for {count}={nnodes}: "
            f"{found.system} gave this node a rank the job does not have"
        )
    return found


def with_cluster_defaults(
    args: argparse.Namespace, name: str = "gpukit launch", env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """``args`` with the node flags left out (None) filled in from the cluster, else with the
    one-machine defaults; prints on stderr one line saying what the cluster said."""
    found = detect(env)
    given = {f: getattr(args, f, None) for f in FIELDS}
    values = resolve(given, found)
    if found is not None:
        print(f"{name}: {summary(found, given, values)}", file=sys.stderr)
    return argparse.Namespace(**{**vars(args), **values})


def resolve(given: Mapping[str, Any], found: ClusterNodes | None) -> dict[str, Any]:
    """The node flags: those given, else the cluster's, else the one-machine defaults (no
    master port: a free one). One machine keeps 127.0.0.1 and a free port whatever the
    cluster names. Refuses ``--nnodes``/``--node-rank`` that contradict the cluster, and a
    cluster that leaves out what several nodes need."""
    values = dict(given)
    if found is not None:
        for name in ("nnodes", "node_rank"):
            ours, theirs = given[name], getattr(found, name)
            if ours is not None and theirs is not None and ours != theirs:
                raise ConfigError(_contradiction(name, ours, theirs, found))
        nnodes = given["nnodes"] or found.nnodes
        if nnodes is None and (found.node_rank or 0) > 0:
            source = found.sources["node_rank"]
            raise ConfigError(
                f"{source}={found.node_rank} says this is node {found.node_rank} of a job whose "
                f"node count {found.system} does not give: give --nnodes and --master-addr"
            )
        nnodes = nnodes or 1
        for name in FIELDS:
            if values[name] is None and (nnodes > 1 or name not in ("master_addr", "master_port")):
                values[name] = getattr(found, name)
        for name in ("node_rank", "master_addr"):
            if nnodes > 1 and values[name] is None:
                count = FLAGS["nnodes"] if given["nnodes"] else found.sources["nnodes"]
                what = "which node this is" if name == "node_rank" else "where node 0 is"
                raise ConfigError(
                    f"{count} says this job has {nnodes} nodes but {found.system} does not say "
                    f"{what} (read {', '.join(found.sources.values())}): give {FLAGS[name]}"
                )
        if values["nproc"] is None and "nproc" in found.sources:
            # Named without a value: the cluster gave a GPU count gpukit cannot read.
            raise ConfigError(
                f"{found.sources['nproc']} is not a GPU count gpukit can read: give --nproc"
            )
    return {name: DEFAULTS.get(name) if values[name] is None else values[name] for name in FIELDS}


def _contradiction(name: str, ours: int, theirs: int, found: ClusterNodes) -> str:
    source, flag = found.sources[name], FLAGS[name]
    said = f"gives this job {theirs} nodes" if name == "nnodes" else f"says this is node {theirs}"
    ask = f", or ask {found.system} for {ours} nodes" if name == "nnodes" else ""
    return (
        f"{flag} {ours} contradicts {source}={theirs}: {found.system} {said}. "
        f"Leave {flag} out (gpukit reads {source}){ask}"
    )


def summary(found: ClusterNodes, given: Mapping[str, Any], values: Mapping[str, Any]) -> str:
    """One line: what the cluster said and where it was read, e.g. ``Slurm job 1234: node 1
    of 2, 8 processes each, master node01:21234 (SLURM_NNODES, SLURM_NODEID, ...)``."""
    nnodes, nproc = values["nnodes"], values["nproc"]
    processes = f"{nproc} process{'es' if nproc > 1 else ''}"
    layout = (
        f"node {values['node_rank']} of {nnodes}, {processes} each, "
        f"master {values['master_addr']}:{values['master_port']}"
        if nnodes > 1
        else f"one node, {processes} on this machine"
    )
    said = [
        FLAGS[name] if given[name] is not None else found.sources[name]
        for name in FIELDS
        if (name in found.sources or given[name] is not None)
        and (nnodes > 1 or name not in ("master_addr", "master_port"))
    ]
    return f"{found.job}: {layout} ({', '.join(dict.fromkeys(said))})"


def _pick(env: Mapping[str, str], *names: str) -> tuple[str | None, str | None]:
    """The first of ``names`` set, and its value."""
    for name in names:
        if name in env:
            return name, env[name]
    return None, None


def _text(env: dict[str, str], sources: dict[str, str], key: str, *names: str) -> str | None:
    name, value = _pick(env, *names)
    if name is not None:
        sources[key] = name
    return value


def _read(
    env: dict[str, str],
    sources: dict[str, str],
    key: str,
    *names: str,
    low: int,
    high: int | None = None,
) -> int | None:
    """The first of ``names`` set, as a whole number in low..high, noted in ``sources``."""
    name, value = _pick(env, *names)
    if name is None or value is None:
        return None
    sources[key] = name
    return _number(name, value, low, high)


def _number(name: str, text: str, low: int, high: int | None = None) -> int:
    # ASCII digits only: str.isdigit() admits '²' and int() admits '٢', neither a cluster's.
    value = int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None
    if value is not None and value >= low and (high is None or value <= high):
        return value
    allowed = f"{low}..{high}" if high is not None else f"{low} or more"
    raise ConfigError(
        f"{name}={text!r} is not a whole number in {allowed}, yet gpukit launch reads it for "
        "the job's nodes: fix or unset it, or give the node flags (--nnodes, --node-rank, "
        "--master-addr, --master-port)"
    )
