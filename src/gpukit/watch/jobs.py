"""Finding the job to watch, and telling whether it still runs, from files alone.

A running launcher keeps its job's whole view in ``JOB/live.json`` (rewritten about once a
second) in its job folder, ``$TMPDIR/gpukit-job-<pid>-*``; ``gpukit train --out OUT`` also
writes that folder's path into ``OUT/job``. :func:`find_job` turns ``gpukit top``'s options
into one job folder (``--job DIR``, ``--out OUT``, or the one job running on this machine) or
a :class:`~gpukit.errors.ConfigError` that says, in one line, why there is none to watch.

Nothing here writes a file, takes a lock or sends a signal: watching cannot slow or stop the
job.

>>> import tempfile
>>> find_job(where=tempfile.mkdtemp())
Traceback (most recent call last):
...
gpukit.errors.ConfigError: no gpukit job is running on this machine ...
"""

from __future__ import annotations

import json
import math
import shlex
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from gpukit.checkpoint import lock as folder_lock
from gpukit.errors import ConfigError
from gpukit.launch.job_folders import PREFIX, launcher_pid, pid_alive

LIVE_FILE = "live.json"  # the launcher's view of the whole job, in its job folder
OUT_JOB_FILE = "job"  # in a run's --out folder: the path of the job folder that writes it
# A launcher rewrites live.json about once a second: a view older than this, whose launcher
# is gone, is a job that was killed before it could say it ended.
STALE_S = 5.0
# What a `gpukit train --out` folder holds from its start: a folder with none of these is no run.
_RUN_FILES = (".gpukit.lock", "config.toml", "metrics.json", "metrics.csv", "checkpoints")
_FIND_HELP = (
    "start one with `gpukit train` or `gpukit launch`, or name one with --job DIR or --out OUT"
)


def read_view(folder: Path) -> dict[str, Any] | None:
    """The job's ``live.json`` as a dict; None when it is missing, half written, unreadable or
    not a JSON object (the next read, a tick later, finds the launcher's next write).

    >>> read_view(Path("/no/such/job")) is None
    True
    """
    try:
        view = json.loads((folder / LIVE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return view if isinstance(view, dict) else None


def find_job(job: str | None = None, out: str | None = None, where: str | None = None) -> Path:
    """The folder of the job to watch: ``job`` itself, the one ``out``'s ``OUT/job`` names, or
    else the one job running under ``where`` (default: the temporary folder). ConfigError,
    in one line, for a folder that is no job or run, a job that ended or was killed, no job
    running, or several (listed, with their command and start time)."""
    if job is not None:
        return _checked(_job_folder(Path(job), f"--job {job}"), f"--job {job}")
    if out is not None:
        return _checked(_out_job(Path(out)), f"--out {out}")
    return _the_running_job(Path(where or tempfile.gettempdir()))


class Stop(NamedTuple):
    """Why a job runs no more: the line that says it, and whether it was killed (its launcher
    vanished) rather than ended."""

    line: str
    killed: bool = False


def stopped(folder: Path, view: dict[str, Any] | None, now: float | None = None) -> Stop | None:
    """Why the job in ``folder`` runs no more; None while it runs: its folder is gone, its view
    says it ended, or its launcher is gone and the view is over :data:`STALE_S` old (a
    launcher killed before it could say so).

    >>> stopped(Path("/no/such/job"), None).line
    'the job ended: its folder /no/such/job is gone (a launcher removes it at the end)'
    """
    if not folder.is_dir():
        return Stop(
            f"the job ended: its folder {folder} is gone (a launcher removes it at the end)"
        )
    if view is None:
        return None
    ended = view.get("ended")
    if ended:
        return Stop(f"the job ended{_how_it_ended(ended)}")
    pid = _launcher_of(folder, view)
    updated = number(view.get("updated"))
    age = (time.time() if now is None else now) - updated if updated is not None else None
    if pid is not None and not pid_alive(pid) and (age is None or age > STALE_S):
        since = f"{age:.0f} s ago" if age is not None else "at an unknown time"
        return Stop(
            f"the job stopped without ending: its launcher (pid {pid}) is gone and {LIVE_FILE} "
            f"was last updated {since} (killed, or its machine went down)",
            killed=True,
        )
    return None


def _job_folder(folder: Path, given: str) -> Path:
    if not folder.exists():
        raise ConfigError(
            f"{given}: no such folder; a job's folder is removed when the job ends, so it may "
            "have ended (its --out folder keeps the run's records)"
        )
    if not folder.is_dir():
        raise ConfigError(f"{given}: that is a file, not a job folder ({PREFIX}* under TMPDIR)")
    if not (folder / LIVE_FILE).exists() and launcher_pid(folder) is None:
        raise ConfigError(
            f"{given}: not a gpukit job folder (it holds no {LIVE_FILE}): give a running job's "
            f"folder ({PREFIX}* under TMPDIR) or --out OUT of a gpukit train run; `gpukit top` "
            "alone finds the job running on this machine"
        )
    return folder


def _out_job(out: Path) -> Path:
    given = f"--out {out}"
    if not out.is_dir():
        what = "that is a file" if out.exists() else "no such folder"
        raise ConfigError(f"{given}: {what}: give the --out folder of a gpukit train run")
    pointer = out / OUT_JOB_FILE
    if not pointer.is_file():
        if any((out / name).exists() for name in _RUN_FILES):
            holder = folder_lock.holder(out)
            running = (
                holder is not None
                and holder.host == socket.gethostname()
                and pid_alive(holder.pid)
                and not (out / "metrics.json").exists()
            )
            if running and holder is not None:  # one process, the one holding the folder
                raise ConfigError(
                    f"{given}: this run is one process, not under gpukit's launcher (pid "
                    f"{holder.pid}: {holder.command}), so no heartbeat is read and there is "
                    f"no live view of it; `gpukit report {out}` draws it so far. To watch a "
                    "run live, start it under the launcher: --devices N, or --hang-timeout 300"
                )
            raise ConfigError(
                f"{given}: no job is running for this run (it has no {pointer.name} file: the "
                f"run ended, or was started by a gpukit that writes none); `gpukit report "
                f"{out}` shows it"
            )
        raise ConfigError(
            f"{given}: not the --out folder of a gpukit train run (no {pointer.name}, "
            "config.toml or metrics): give the folder that was passed to --out"
        )
    try:
        folder = Path(pointer.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{given}: cannot read {pointer}: {err}") from err
    if not folder.is_dir():
        # A shared OUT read on another node than node 0's: the folder is on that machine.
        holder = folder_lock.holder(out)
        if holder is not None and holder.host != socket.gethostname():
            raise ConfigError(
                f"{given}: the run's job folder {folder} (named in {pointer}) is on host "
                f"{holder.host}, whose {holder.describe()} holds the run (not checked from "
                "here): run gpukit top there, or `gpukit top` alone on a node of the job"
            )
        raise ConfigError(
            f"{given}: the run's job has ended: its folder {folder} (named in {pointer}) is gone"
        )
    return folder


def _checked(folder: Path, given: str) -> Path:
    """``folder`` when its job runs; ConfigError saying how it stopped otherwise."""
    view = read_view(folder)
    why = stopped(folder, view)
    if why is not None:
        raise ConfigError(f"{given}: {why.line}")
    pid = _launcher_of(folder, view)
    if view is None and pid is not None and not pid_alive(pid):
        raise ConfigError(
            f"{given}: its launcher (pid {pid}) is gone and it holds no {LIVE_FILE}: the job "
            "was killed"
        )
    return folder


def _the_running_job(where: Path) -> Path:
    folders = sorted(where.glob(f"{PREFIX}*"))
    running = [f for f in folders if _runs(f)]
    if not running:
        silent = [f for f in folders if not (f / LIVE_FILE).exists() and _launcher_alive(f)]
        if silent:  # a launcher that has not written its first view yet, or never will
            raise ConfigError(
                f"no gpukit job here publishes its view yet: {len(silent)} running job folder"
                f"{'s' if len(silent) > 1 else ''} without a {LIVE_FILE} under {where} (a "
                "launcher writes its first one a second after it starts): try again, or name "
                f"the job with --job DIR ({silent[0]})"
            )
        raise ConfigError(
            f"no gpukit job is running on this machine (no live {PREFIX}* folder with a "
            f"{LIVE_FILE} under {where}): {_FIND_HELP}"
        )
    if len(running) > 1:
        listed = "\n".join(f"  {_described(f)}" for f in running)
        raise ConfigError(
            f"{len(running)} gpukit jobs are running on this machine: choose one with "
            f"--job DIR:\n{listed}"
        )
    return running[0]


def _runs(folder: Path) -> bool:
    """Whether ``folder`` is a running job's that publishes its view."""
    if not (folder / LIVE_FILE).is_file():
        return False  # a launcher that writes no view yet, or a leftover
    view = read_view(folder)
    pid = _launcher_of(folder, view)
    return (pid is None or pid_alive(pid)) and stopped(folder, view) is None


def _launcher_alive(folder: Path) -> bool:
    pid = launcher_pid(folder)
    return pid is not None and pid_alive(pid)


def _described(folder: Path) -> str:
    """One line for a job in a list: its folder, start time and command."""
    view = read_view(folder) or {}
    started = number(view.get("started"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    command = view.get("command")
    shown = shlex.join(map(str, command)) if isinstance(command, list) else "?"
    return f"{folder}  started {when}  {shown}"


def _how_it_ended(ended: Any) -> str:
    """``: finished (exit code 0) at 14:02:11``, from the view's "ended" record."""
    if not isinstance(ended, dict):
        return ""
    text = f": {ended.get('how') or 'ended'}"
    if ended.get("code") is not None:
        text += f" (exit code {ended['code']})"
    at = number(ended.get("time"))
    if at is not None:
        text += f" at {time.strftime('%H:%M:%S', time.localtime(at))}"
    return text


def _launcher_of(folder: Path, view: dict[str, Any] | None) -> int | None:
    pid = (view or {}).get("launcher_pid")
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        return pid
    return launcher_pid(folder)


def number(value: Any) -> float | None:
    """A field of the view as a finite number; None for anything else (a view is JSON from
    another process, perhaps of another version: ``true``, ``"12"``, ``NaN`` are no numbers).

    >>> number(3), number(True), number(float("nan")), number("12")
    (3.0, None, None, None)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
