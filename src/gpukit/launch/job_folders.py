"""The launcher's job folder (``$TMPDIR/gpukit-job-<pid>-<random>``): made for each job, held
while the launcher lives, and removed when it ends; a launcher that was killed (SIGKILL, the
machine's OOM killer) cannot remove its own, so the next launcher does.

A launcher holds an ``flock`` on the folder's :data:`OWNER_FILE` for as long as it runs (the
kernel frees it when the process dies, however it dies) and puts its pid in the folder's name.
A folder whose lock is free and whose pid is gone is a leftover: :func:`sweep` removes it,
unless it holds a hang report, which the launcher keeps for the user on purpose.

>>> folder = fresh_job_dir()
>>> folder.name.startswith("gpukit-job-"), (folder / OWNER_FILE).is_file()
(True, True)
>>> release(folder)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from gpukit._util.files import write_error
from gpukit.launch.hang_reports import REPORT_FILE

try:
    import fcntl
except ImportError:  # Windows: no flock; leftovers are never swept
    fcntl = None  # type: ignore[assignment]

PREFIX = "gpukit-job-"
OWNER_FILE = "owner.lock"
_HELD: dict[Path, int] = {}  # job folder -> the descriptor that holds its lock


def fresh_job_dir() -> Path:
    """A new folder for one job's heartbeats, error records and stack dumps, held by this
    process until :func:`release`. A temporary folder the disk refuses is an
    :class:`~gpukit.errors.OutputWriteError` naming it."""
    where = tempfile.gettempdir()
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=where))
    except OSError as err:
        raise write_error(
            Path(where) / f"{PREFIX}{os.getpid()}-*", err, option="TMPDIR=a writable folder"
        ) from err
    if fcntl is not None:
        try:
            fd = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as err:
            shutil.rmtree(folder, ignore_errors=True)
            raise write_error(folder / OWNER_FILE, err, option="TMPDIR=a writable folder") from err
        fcntl.flock(fd, fcntl.LOCK_EX)
        _HELD[folder] = fd
    return folder


def release(folder: Path) -> None:
    """Give up the hold on ``folder`` (made by :func:`fresh_job_dir`) before removing it."""
    fd = _HELD.pop(folder, None)
    if fd is not None:
        os.close(fd)


def sweep(where: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the job folders under ``where`` (default: the temporary folder) that killed
    launchers left: no process holds their lock and their launcher's pid is gone. Folders
    with a hang report stay. Returns the ones removed."""
    if fcntl is None:
        return []
    removed = []
    for folder in sorted(Path(where or tempfile.gettempdir()).glob(f"{PREFIX}*")):
        if folder in _HELD or (folder / REPORT_FILE).exists() or not _left_over(folder):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            removed.append(folder)
    return removed


def swept(name: str) -> list[str]:
    """:func:`sweep`, in the words a launcher named ``name`` says it with."""
    return [f"{name}: removed {f}, left by a launcher that was killed" for f in sweep()]


def _left_over(folder: Path) -> bool:
    """Whether ``folder`` is a dead launcher's: its pid is gone and its lock is free."""
    pid = launcher_pid(folder)
    if pid is None or pid_alive(pid):
        return False
    try:
        fd = os.open(folder / OWNER_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # not a folder this launcher made (or not readable): leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # frees the lock again


def launcher_pid(folder: Path) -> int | None:
    """The pid of the launcher that made ``folder``, from its name; None for another name."""
    head = folder.name[len(PREFIX) :].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (signal 0 is only a question: nothing reaches it); a
    zombie does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    # A zombie is dead: it will never release anything.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True
