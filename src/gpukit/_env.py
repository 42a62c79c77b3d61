"""The one place that reads gpukit's environment variables (all prefixed ``GPUKIT_``).

Other modules ask here, so the full list of variables lives in one file:

- ``GPUKIT_DEVICE``: the device ``gk.device()`` returns when asked for the best one
  (any spelling ``gk.device`` accepts, e.g. ``cpu`` or ``/gpu:1``).
- ``GPUKIT_FAULT_OOM_ABOVE``: fault injection for testing out-of-memory recovery:
  ``rt.train_step`` raises a real ``torch.OutOfMemoryError`` for every micro-batch of more
  than this many samples.
- ``GPUKIT_COLLECTIVE_CHECK_TIMEOUT``: seconds ``rt.save`` waits for every rank to arrive
  before it fails naming the missing ones (default 30).
- ``GPUKIT_FAULT``: faults injected on purpose, ``KIND:RANK:STEP[,...]`` (see
  ``gpukit.launch.faults``), to rehearse crashes, hangs, preemption and NaNs.
- ``GPUKIT_JOB_DIR`` and ``GPUKIT_ATTEMPT``: set by gpukit's launcher in each process it
  starts: the job's folder (heartbeats, stack dumps, which injected faults have fired) and
  which attempt of the job this is (0, then 1, 2, ... after restarts).
- ``GPUKIT_STOP_GRACE``: seconds a launcher gives its ranks to save and exit after SIGTERM or
  Ctrl-C (default 25), before it kills them.
- ``GPUKIT_STARTUP_TIMEOUT``: seconds a rank of a job under gpukit's launcher may take from its
  start to its first heartbeat (imports, rendezvous, data) before the job is stopped as stuck
  in start-up, once another rank has beaten (default 900; 0: never).
- ``GPUKIT_WARM_START``: the socket of a warm-start server (``python -m gpukit.launch.warm
  SOCKET``): gpukit's launcher then forks each rank from that server, which has imported torch
  and gpukit already, instead of starting a fresh interpreter (see ``gpukit.launch.warm``).
- ``GPUKIT_WARM_RESTART``: ``0`` keeps gpukit's launcher from starting a warm-start server of
  its own for a job that may restart (``gpukit.launch.warm_restarts``): restarted attempts then
  start cold, as the first one does.
- ``GPUKIT_WARM_PARENT``: set in each rank the warm-start server forks: the process id of the
  launcher that asked for it, which a cold start would have made the rank's parent.
- ``GPUKIT_RENDEZVOUS_TIMEOUT``: seconds a launched rank waits for every rank of its job to
  join the process group before it fails saying who waited where (default 120).
- ``GPUKIT_RENDEZVOUS_LAST_CALL``: on several machines with ``--nnodes MIN:MAX``, seconds the
  meeting stays open for more machines once MIN have come (default 30, torchrun's).
- ``GPUKIT_CACHE_DIR``: the folder where gpukit keeps what it measured on this machine (the
  copy speeds and latencies of ``gpukit bench transfer``, which ``gk.trace`` ranks its
  findings with); default ``$XDG_CACHE_HOME/gpukit``, else ``~/.cache/gpukit``.

Numbers are written in ASCII digits: ``int()`` and ``float()`` would also read '٣٠' or
full-width '３０' as 30, which is refused, naming the variable.

``CUDA_LAUNCH_BLOCKING`` is set here for ``gpukit trace --blocking``,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` for ``gpukit launch`` on several machines,
and ``MLFLOW_ALLOW_FILE_STORE`` for the MLflow logger's folder store; ``WANDB_API_KEY`` and
``WANDB_MODE`` are read for the W&B logger's default mode. The CUDA variables that gpukit reads
only to explain things (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``) and the variables a
launcher such as torchrun sets for each process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) are read here too, and so are the
variables by which Slurm (``SLURM_*``) and Kubernetes (``KUBERNETES_SERVICE_HOST``, the
``PET_*`` variables of Kubeflow, ``JOB_COMPLETION_INDEX``) describe a job's nodes, which
``gpukit.launch.clusters`` interprets.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def default_device_spec() -> str | None:
    """``GPUKIT_DEVICE``, or None when unset or blank."""
    value = os.environ.get("GPUKIT_DEVICE", "").strip()
    return value or None


def fault_oom_above() -> int | None:
    """``GPUKIT_FAULT_OOM_ABOVE`` as a sample count, or None when unset or blank."""
    value = os.environ.get("GPUKIT_FAULT_OOM_ABOVE", "").strip()
    if not value:
        return None
    _require_ascii("GPUKIT_FAULT_OOM_ABOVE", value)
    if not value.isdigit() or int(value) < 1:
        from gpukit.errors import ConfigError

        raise ConfigError(
            f"GPUKIT_FAULT_OOM_ABOVE={value!r}: give a whole number of samples of at least 1 "
            "(micro-batches larger than it fail as if out of memory), or unset it"
        )
    return int(value)


def fault_spec() -> str | None:
    """``GPUKIT_FAULT``, or None when unset or blank (parsed by ``gpukit.launch.faults``)."""
    value = os.environ.get("GPUKIT_FAULT", "").strip()
    return value or None


def job_dir() -> Path | None:
    """``GPUKIT_JOB_DIR``: the folder gpukit's launcher keeps for this job, or None."""
    value = os.environ.get("GPUKIT_JOB_DIR", "").strip()
    return Path(value) if value else None


def warm_parent() -> int | None:
    """``GPUKIT_WARM_PARENT``: the launcher of this rank when the warm-start server forked it
    (its parent is then the server), else None."""
    value = os.environ.get("GPUKIT_WARM_PARENT", "").strip()
    return int(value) if value.isascii() and value.isdigit() else None


def attempt() -> int:
    """``GPUKIT_ATTEMPT``: 0 for the first start of a job, K after K restarts."""
    value = os.environ.get("GPUKIT_ATTEMPT", "").strip()
    if not value:
        return 0
    _require_ascii("GPUKIT_ATTEMPT", value)
    return int(value) if value.isdigit() else 0


def collective_check_timeout() -> float:
    """``GPUKIT_COLLECTIVE_CHECK_TIMEOUT`` in seconds (default 30)."""
    return _seconds(
        "GPUKIT_COLLECTIVE_CHECK_TIMEOUT", 30.0, "how long a collective call waits for every rank"
    )


def rendezvous_timeout() -> float:
    """``GPUKIT_RENDEZVOUS_TIMEOUT`` in seconds (default 120): how long a launched rank waits
    for the others to join its process group."""
    return _seconds(
        "GPUKIT_RENDEZVOUS_TIMEOUT", 120.0, "how long a launched rank waits for the others to join"
    )


def rendezvous_last_call() -> float:
    """``GPUKIT_RENDEZVOUS_LAST_CALL`` in seconds (default 30, torch's elastic default): how
    long an elastic job's meeting waits for more machines once the fewest it needs are there."""
    return _seconds(
        "GPUKIT_RENDEZVOUS_LAST_CALL",
        30.0,
        "how long an elastic job's meeting waits for more machines",
    )


def startup_timeout() -> float:
    """``GPUKIT_STARTUP_TIMEOUT`` in seconds (default 900; 0: never): how long a launched rank
    may take to its first heartbeat. Importing torch from a busy shared file system takes
    minutes on a cluster, and a rank then joins the process group and may load data before it
    beats: 15 minutes is well above a slow start, yet ends a job stuck there (a dead mount, an
    import that deadlocked) twice as fast as gloo's 30 min collective timeout would, which
    names nobody."""
    return _seconds(
        "GPUKIT_STARTUP_TIMEOUT",
        900.0,
        "how long a launched rank may take to its first heartbeat; 0: never",
        zero=True,
    )


def warm_start() -> str | None:
    """``GPUKIT_WARM_START``: the warm-start server's socket path, or None to start ranks cold."""
    return os.environ.get("GPUKIT_WARM_START", "").strip() or None


def warm_restart() -> bool:
    """``GPUKIT_WARM_RESTART``: whether a job that may restart keeps a warm-start server of its
    own for its restarts (unset or ``1``: yes; ``0``: no).

    >>> os.environ["GPUKIT_WARM_RESTART"] = "0"
    >>> warm_restart()
    False
    >>> os.environ["GPUKIT_WARM_RESTART"] = "off"
    >>> warm_restart()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: GPUKIT_WARM_RESTART='off': give 1 (restarts fork ...
    >>> del os.environ["GPUKIT_WARM_RESTART"]
    """
    value = os.environ.get("GPUKIT_WARM_RESTART", "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    from gpukit.errors import ConfigError

    raise ConfigError(
        f"GPUKIT_WARM_RESTART={value!r}: give 1 (restarts fork their ranks from a warm-start "
        "server the launcher keeps) or 0 (every attempt starts its ranks cold), or unset it"
    )


def _seconds(name: str, default: float, meaning: str, zero: bool = False) -> float:
    """Variable ``name`` as a positive number of seconds (or 0, with ``zero``), ``default``
    when unset or blank."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    _require_ascii(name, value)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    low_ok = seconds >= 0 if zero else seconds > 0
    if not low_ok or seconds == float("inf"):
        from gpukit.errors import ConfigError

        allowed = "0 or more seconds" if zero else "a positive number of seconds"
        raise ConfigError(f"{name}={value!r}: give {allowed} ({meaning}), or unset it")
    return seconds


def _require_ascii(name: str, value: str) -> None:
    """Refuse a number written with other than ASCII characters: Python's int() and float()
    read the digits of every script ('٣٠', full-width '３０'), which a reader of the
    environment would take for text, so the number a run uses is never in doubt.

    >>> _require_ascii("GPUKIT_RENDEZVOUS_TIMEOUT", "30")
    >>> _require_ascii("GPUKIT_RENDEZVOUS_TIMEOUT", "３０")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: GPUKIT_RENDEZVOUS_TIMEOUT='３０' holds characters other than ...
    """
    if value.isascii():
        return
    from gpukit.errors import ConfigError

    odd = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in dict.fromkeys(value) if not c.isascii())
    raise ConfigError(
        f"{name}={value!r} holds characters other than ASCII: {odd}. Write the number with "
        f"the ASCII digits 0-9 (e.g. {name}=30), or unset it"
    )


def master_endpoint() -> tuple[str | None, str | None]:
    """``MASTER_ADDR`` and ``MASTER_PORT`` as a launcher set them (None where unset or blank),
    the address where rank 0 hosts the rendezvous."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    port = os.environ.get("MASTER_PORT", "").strip()
    return addr or None, port or None


def torchelastic_agent_store() -> bool:
    """``TORCHELASTIC_USE_AGENT_STORE``: torchrun's agent hosts the rendezvous store at
    ``MASTER_ADDR:MASTER_PORT``, so rank 0 joins it rather than opening one."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").strip() == "True"


def torchrun_agent() -> int | None:
    """The process id of the torchrun agent that started this process: its parent, when
    ``TORCHELASTIC_RUN_ID`` says torchrun did, ``GPUKIT_JOB_DIR`` says gpukit's own launcher
    did not, and the parent's command line is torchrun's (not a wrapper script torchrun ran
    with ``--no-python``); else None."""
    if not os.environ.get("TORCHELASTIC_RUN_ID", "").strip() or job_dir() is not None:
        return None
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as file:
            words = file.read().decode(errors="replace").split("\0")
    except OSError:
        return None  # no /proc (macOS): better no word than one to the wrong process
    torchrun = any(w.endswith("torchrun") or w == "torch.distributed.run" for w in words)
    # `gpukit launch --nnodes` runs torchrun's agent in its own process.
    ours = "launch" in words and any(w.endswith("gpukit") for w in words)
    return parent if parent > 1 and (torchrun or ours) else None


def restart_count() -> int:
    """How many times a launcher restarted this job: ``GPUKIT_ATTEMPT`` (gpukit's launcher),
    else ``TORCHELASTIC_RESTART_COUNT`` (torchrun), else 0."""
    for name in ("GPUKIT_ATTEMPT", "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "").strip()
        if value.isascii() and value.isdigit():
            return int(value)
    return 0


def stop_grace() -> float:
    """``GPUKIT_STOP_GRACE`` in seconds (default 25): how long a launcher gives its ranks to
    save and exit after a stop request, under the 30 s that Slurm (``KillWait``) and
    Kubernetes (``terminationGracePeriodSeconds``) allow by default before SIGKILL."""
    return _seconds("GPUKIT_STOP_GRACE", 25.0, "how long ranks get to save and exit when stopped")


# Variables outside the SLURM_ and PET_ families that describe a cluster job's nodes.
_CLUSTER = (
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
)


def cluster_variables() -> dict[str, str]:
    """The variables by which Slurm and Kubernetes describe the job this process runs in
    (``SLURM_*``, ``PET_*`` and those of :data:`_CLUSTER`), stripped, the blank ones left out."""
    found = {}
    for name, value in os.environ.items():
        if (name.startswith(("SLURM_", "PET_")) or name in _CLUSTER) and value.strip():
            found[name] = value.strip()
    return found


def environment() -> dict[str, str]:
    """A copy of this process's environment, for the processes a launcher starts."""
    return dict(os.environ)


def share_rendezvous_store(shared: bool) -> None:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``: with ``shared=False`` torch's c10d rendezvous
    starts no store for the ranks on its rank 0 to keep across rounds (gpukit's launcher gives
    the ranks of each attempt a fresh port of their own)."""
    if shared:
        os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    else:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"


def cache_dir() -> Path:
    """``GPUKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpukit``, else ``~/.cache/gpukit`` (the
    folder may not exist yet). A relative ``XDG_CACHE_HOME`` is ignored, as the XDG base
    directory specification asks."""
    value = os.environ.get("GPUKIT_CACHE_DIR", "").strip()
    if value:
        return Path(value).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "gpukit"
    return Path.home() / ".cache" / "gpukit"


def set_cuda_launch_blocking() -> None:
    """``CUDA_LAUNCH_BLOCKING=1``: every kernel launch waits for the kernel, so a CUDA error is
    raised at the line that caused it (CUDA reads this when it starts, so set it before)."""
    os.environ["CUDA_LAUNCH_BLOCKING"] = "1"


def wandb_api_key() -> bool:
    """Whether ``WANDB_API_KEY`` is set (gpukit's W&B logger then leaves the mode to wandb)."""
    return bool(os.environ.get("WANDB_API_KEY", "").strip())


def wandb_mode() -> str | None:
    """``WANDB_MODE`` as set (offline, online, disabled), or None when unset."""
    return os.environ.get("WANDB_MODE", "").strip() or None


def allow_mlflow_file_store() -> None:
    """``MLFLOW_ALLOW_FILE_STORE=true`` unless it is set: MLflow 3 refuses its folder store
    without it, and a folder is what gpukit's MLflow logger writes to when given one."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as set (possibly empty), or None when unset."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def columns() -> int | None:
    """``COLUMNS``: how wide the user asked text to be laid out (a positive whole number),
    else None; what a program printing off a terminal goes by.

    >>> os.environ["COLUMNS"] = "110"; columns()
    110
    >>> os.environ["COLUMNS"] = "wide"; columns() is None
    True
    >>> del os.environ["COLUMNS"]
    """
    value = os.environ.get("COLUMNS", "").strip()
    return int(value) if value.isascii() and value.isdigit() and int(value) > 0 else None


def cuda_device_order() -> str | None:
    """``CUDA_DEVICE_ORDER`` as set, or None when unset (CUDA then orders fastest first)."""
    return os.environ.get("CUDA_DEVICE_ORDER")


# What steers one run of this process and must not steer the planner's simulation of another:
# injected faults (they would fire in the simulated steps) and this process's place in a
# launched job (its rank, its heartbeats and fault markers in the job's folder).
_RUN_ONLY = (
    "GPUKIT_FAULT_OOM_ABOVE",
    "GPUKIT_FAULT",
    "GPUKIT_JOB_DIR",
    "GPUKIT_ATTEMPT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@contextlib.contextmanager
def apart_from_this_run() -> Iterator[None]:
    """The variables of :data:`_RUN_ONLY` unset inside, restored on leaving: the planner's
    simulation plans a run of its own, whatever job this process belongs to.

    >>> os.environ["RANK"] = "3"
    >>> with apart_from_this_run():
    ...     "RANK" in os.environ
    False
    >>> os.environ.pop("RANK")
    '3'
    """
    saved = {name: os.environ.pop(name) for name in _RUN_ONLY if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
