"""One run per folder: an OS file lock on a run's ``--out`` or checkpoints folder.

Two runs writing one folder mix their metrics and prune or replace each other's checkpoints.
So a run holds ``.gpukit.lock`` inside its folder with ``fcntl.flock``: the kernel frees it
when the process ends, however it ends (a crash, SIGKILL), so no stale lock outlives its run.
The file says who holds it (pid, host, start time, command), and a second run into the folder
is refused at once with a ``ConfigError`` naming that holder.

Who holds it: ``gpukit train --out DIR`` holds DIR in the process the command started (the
launcher, for a job of several processes); a ``gk.Runtime(checkpoints=...)`` holds its folder
on rank 0. A lock held by this very job is not a conflict: by this process (another Runtime
of the same program), by a process that started this one (the launcher, ``rt.launch``'s
parent), or by an earlier attempt of the same job of gpukit's launcher (a rank being killed
after a failure, whose leftover children may hold it a moment longer).

On a system without ``fcntl`` (Windows) folders are not locked.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     lock = hold(tmp, command="doctest", fix="use another folder")
...     again = hold(tmp, command="doctest", fix="use another folder")  # this process: fine
...     print(holder(tmp).command, lock is again)
...     again.release(); lock.release()
doctest True
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from gpukit import _env
from gpukit.errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".gpukit.lock"
_LEFTOVER_WAIT_S = 5.0  # a dead holder's children (DataLoader workers) are on their way out


@dataclass(frozen=True)
class Holder:
    """Who holds a folder, as its lock file says."""

    pid: int
    host: str
    started: str
    command: str
    job: str | None = None

    def describe(self) -> str:
        """``pid 1234 on host h since 2026-11-25 23:50:01 (gpukit train)``."""
        return f"pid {self.pid} on host {self.host} since {self.started} ({self.command})"


class FolderLock:
    """The lock this process holds on ``folder`` (or shares with its own job); ``release``
    gives it back (the Runtime's teardown, the end of ``gpukit train``, or the exit)."""

    def __init__(self, folder: Path, fd: int | None, created: list[Path]) -> None:
        self.folder = folder
        self._fd = fd  # None: held by this job elsewhere (a launcher, an earlier attempt)
        self._created = created  # folders made for the lock, removed again if left empty
        self._owner = os.getpid()
        self._count = 1

    @property
    def held(self) -> bool:
        """This process holds the OS lock itself (not only its job)."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back once every ``hold`` of it in this process has released it; the
        lock file and the folders made for it go too, when nothing else is in them."""
        self._count -= 1
        if self._count > 0:
            return
        _HELD.pop(_key(self.folder), None)
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if os.getpid() == self._owner:  # a forked child only drops its copy of the handle
            with contextlib.suppress(OSError):
                if os.stat(self.folder / LOCK_FILE).st_ino == os.fstat(fd).st_ino:
                    (self.folder / LOCK_FILE).unlink()
            for folder in reversed(self._created):
                with contextlib.suppress(OSError):
                    folder.rmdir()
        os.close(fd)  # closing frees the lock; never LOCK_UN, which would free a parent's too


_HELD: dict[str, FolderLock] = {}


def hold(folder: str | os.PathLike[str], *, command: str, fix: str) -> FolderLock:
    """Lock ``folder`` (created when missing) for this run, or raise ConfigError naming the
    holder: ``DIR is in use by pid 1234 on host h since ... (gpukit train): FIX``."""
    path = Path(folder)
    known = _HELD.get(_key(path))
    if known is not None:
        known._count += 1
        return known
    created = _make(path)
    if fcntl is None:
        return _register(FolderLock(path, None, created))
    deadline = time.monotonic() + _LEFTOVER_WAIT_S
    while True:
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise _unwritable(path, "cannot write its lock file", err) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            found = _read_when_written(path)
            if found is not None and _same_job(found):
                return _register(FolderLock(path, None, created))
            if found is not None and _dead_here(found) and time.monotonic() < deadline:
                time.sleep(0.1)  # its leftover children hold it until they exit
                continue
            for made in reversed(created):
                with contextlib.suppress(OSError):
                    made.rmdir()
            who = found.describe() if found is not None else "another process"
            if found is not None and _dead_here(found):
                who = f"the processes left by {who}, which has ended (its children hold it)"
            raise ConfigError(f"{path} is in use by {who}: {fix}") from None
        try:
            same = os.stat(path / LOCK_FILE).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its holder removed the file as it released it: lock the new one
            os.close(fd)
            continue
        try:
            _write(fd, command)
        except OSError as err:  # a full disk, a size limit: the record does not fit
            os.close(fd)
            with contextlib.suppress(OSError):
                (path / LOCK_FILE).unlink()
            for made in reversed(created):
                with contextlib.suppress(OSError):
                    made.rmdir()
            raise _unwritable(path, "cannot write its lock file", err) from err
        return _register(FolderLock(path, fd, created))


def holder(folder: str | os.PathLike[str]) -> Holder | None:
    """Who the lock file in ``folder`` names (the last holder, if none holds it now)."""
    try:
        data = json.loads((Path(folder) / LOCK_FILE).read_text())
        return Holder(
            int(data["pid"]),
            str(data["host"]),
            str(data["started"]),
            str(data["command"]),
            data.get("job"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def this_program() -> str:
    """This process's command, short, for the lock file: ``gpukit train``, ``train.py``."""
    import sys

    argv = list(sys.argv) or ["python"]
    first = Path(argv[0])
    if first.name == "__main__.py":  # python -m package ...
        argv[0] = first.parent.name
    else:
        argv[0] = first.name or "python"
    text = " ".join(argv[:3])
    return text if len(text) <= 60 else text[:57] + "..."


def held_here(folder: str | os.PathLike[str]) -> bool:
    """Whether this process holds ``folder``, or shares it with its own job."""
    return _key(Path(folder)) in _HELD


def _register(lock: FolderLock) -> FolderLock:
    _HELD[_key(lock.folder)] = lock
    return lock


def _key(folder: Path) -> str:
    return os.path.realpath(folder)


def _make(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, outermost first."""
    created = [p for p in reversed([folder, *folder.parents]) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _unwritable(folder, "cannot create it", err) from err
    return created


def _unwritable(folder: Path, what: str, err: OSError) -> ConfigError:
    """The ConfigError for a folder this run cannot write (its cause: the OSError)."""
    said = err.strerror or type(err).__name__
    if err.errno is not None and err.errno in errno.errorcode:
        said += f", {errno.errorcode[err.errno]}"
    return ConfigError(
        f"{folder}: {what} ({said}): give a folder you can write, or fix its permissions"
    )


def _write(fd: int, command: str) -> None:
    data = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command,
        "job": str(_env.job_dir()) if _env.job_dir() is not None else None,
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(data) + "\n").encode(), 0)


def _read_when_written(folder: Path) -> Holder | None:
    """The holder's record; a holder that has just taken the lock writes it a moment later."""
    for _ in range(10):
        found = holder(folder)
        if found is not None:
            return found
        time.sleep(0.05)
    return None


def _same_job(found: Holder) -> bool:
    """The holder is this job: this process, a process that started it, or (under gpukit's
    launcher) a rank of the same job."""
    if found.host != socket.gethostname():
        return False
    job = _env.job_dir()
    if job is not None and found.job == str(job):
        return True
    return found.pid == os.getpid() or found.pid in _ancestors()


def _dead_here(found: Holder) -> bool:
    """The holder's own process is gone on this host (its children may still hold the lock)."""
    if found.host != socket.gethostname():
        return False
    try:
        os.kill(found.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _ancestors() -> set[int]:
    """The ids of the processes that started this one (Linux: all of them; else the parent).
    A rank forked by the warm-start server counts the launcher that asked for it as its
    parent, as a cold start would have made it."""
    found = _line_of(os.getppid(), set())
    warm_parent = _env.warm_parent()
    return found if warm_parent is None else _line_of(warm_parent, found)


def _line_of(pid: int, found: set[int]) -> set[int]:
    """``found`` with ``pid`` and the processes that started it, as far as /proc tells."""
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state: the parent
    return found


@atexit.register
def _release_all() -> None:
    for lock in list(_HELD.values()):
        lock._count = 1
        lock.release()
