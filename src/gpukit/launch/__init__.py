"""gpukit's launcher: ``nproc`` ranks of a command on this machine, watched and restarted,
alone or as one node of a job over several.

``run_job`` (``job``) starts one process per rank with the variables torchrun would give it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``, ``TORCHELASTIC_ERROR_FILE``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``) plus ``GPUKIT_JOB_DIR`` (one folder per job, kept across attempts:
heartbeats, error records, stack dumps) and ``GPUKIT_ATTEMPT`` (0, 1, ...). Then:

- **failures**: when a rank fails, the others get a short grace and are SIGKILLed with their
  process groups; the headline names the rank that failed first, with its step and phase
  (``workers``, ``failures``);
- **hangs**: when a rank has not beaten for ``hang_timeout`` seconds (counted from its first
  beat, once every rank has beaten), every rank writes its stacks, the report names the stuck
  rank and its line, and all are stopped; a rank that has not beaten ``startup_timeout``
  seconds after its start, while another has, is reported the same way as stuck in start-up
  (``hang_watch``, ``hang_reports``);
- **restarts**: a failed attempt is started again, every rank, on a fresh port, up to
  ``max_restarts`` times, unless the job never took a step or its failed attempts keep saving
  nothing new (``restarts``);
- **preemption**: SIGTERM/SIGINT to the launcher, or to any rank, reaches every rank: they save
  at one step and exit 143, and so does the launcher, without restarting (``supervisor``);
- **no orphans**: workers die with the launcher, even when it is SIGKILLed (Linux; elsewhere
  when it exits or is signalled);
- **the job's view**: about once a second every rank's figures from its beats (``rank_stats``)
  and its GPU (``gpu_watch``) go into ``live.json`` in the job's folder, a rank that stays
  slower than the others is named once (``stragglers``), and the job's events are kept there
  and in a record folder (``job_view``, ``job_records``).

Several machines (``nodes``): every node runs this same launcher, and the nodes' launchers meet
at each attempt through torch's c10d rendezvous (``rendezvous``), then tell each other every
failure, stop request and outcome (``node_messages``, over the store in ``node_channel``): the
guarantees above hold across the nodes, the first failure named and the restart decided are the
same on every node.
"""

from gpukit.launch.job import (
    DEFAULT_HANG_TIMEOUT,
    GRACE_S,
    INTERRUPTED_EXIT,
    RUNNER,
    run_job,
    watch_settings,
)
from gpukit.launch.rendezvous import Nodes

__all__ = [
    "DEFAULT_HANG_TIMEOUT",
    "GRACE_S",
    "INTERRUPTED_EXIT",
    "RUNNER",
    "Nodes",
    "run_job",
    "watch_settings",
]
