"""Writing the files gpukit makes so that a failed write is one clear error and leaves
nothing half-written.

A file replaced whole (``metrics.json``, ``config.toml``, a plot, a report) is written under a
temporary name in its own folder and renamed over the old one (:func:`write_atomic`,
:func:`replaced`): a reader, or the next run, sees the old file or the new one, never half of
one. A file that grows (``metrics.csv``) is cut back to its last whole line when an append
fails (:func:`append`). Either way the disk's refusal becomes an
:class:`~gpukit.errors.OutputWriteError` naming the file, the errno and the fix
(:func:`write_error`), which gpukit's launcher does not restart: the same write would fail
again.

>>> import tempfile
>>> from pathlib import Path
>>> path = Path(tempfile.mkdtemp()) / "a.txt"
>>> write_atomic(path, "one\\n")
>>> append(path, "two\\n")
>>> path.read_text()
'one\\ntwo\\n'
>>> print(write_error(path / "b.txt", NotADirectoryError(20, "Not a directory")))
... # doctest: +ELLIPSIS
could not write .../a.txt/b.txt: a file stands where a folder should be (ENOTDIR) [Not a...
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
from collections.abc import Iterator
from pathlib import Path

from gpukit._util.text import format_bytes
from gpukit.errors import OutputWriteError

try:
    import resource
except ImportError:  # Windows: no file-size limit to read
    resource = None  # type: ignore[assignment]

_NO_ROOM = (errnos.ENOSPC, errnos.EDQUOT)


def size_limit() -> int | None:
    """This process's file-size limit in bytes (``ulimit -f``), or None when unlimited."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def reason(code: int | None, option: str = "--out") -> tuple[str, str]:
    """(what happened, the fix) for a write that failed with errno ``code``; ``option`` is
    how the user names the folder (``--out``).

    >>> import errno
    >>> reason(errno.EROFS)[0]
    'the file system is read-only'
    """
    if code in _NO_ROOM:
        return (
            "the disk is full",
            f"free space there, or give a folder on a disk with room ({option})",
        )
    if code == errnos.EFBIG:
        limit = size_limit()
        which = f"this process may write files of {format_bytes(limit)} at most (ulimit -f)"
        return (
            "the file would pass the largest size allowed: "
            + (which if limit is not None else "the file system's limit"),
            "raise the limit (ulimit -f unlimited) or use a file system that allows larger files",
        )
    if code in (errnos.EACCES, errnos.EPERM):
        return (
            f"permission denied to this user (uid {os.getuid()})",
            f"give the user write permission on the folder (chmod, chown), or give another "
            f"folder ({option})",
        )
    if code == errnos.EROFS:
        return (
            "the file system is read-only",
            f"give a folder on a writable disk ({option}), or remount it read-write",
        )
    if code == errnos.EISDIR:
        return (
            "a folder stands where the file goes",
            "move that folder away, or give another folder",
        )
    if code == errnos.ENOTDIR:
        return (
            "a file stands where a folder should be",
            "move that file away, or give another folder",
        )
    return "the write failed", f"check the disk and the folder, or give another folder ({option})"


def write_error(
    path: str | os.PathLike[str],
    err: OSError,
    *,
    kept: str = "nothing half-written was left",
    option: str = "--out",
) -> OutputWriteError:
    """The one error for ``err``, a write of ``path`` the disk refused: the file, what
    happened with its errno's name, the system's words, what is left, the fix."""
    code = err.errno
    what, fix = reason(code, option)
    known = errnos.errorcode.get(code) if code is not None else None
    name = f" ({known})" if known else ""
    said = err.strerror or str(err) or type(err).__name__
    error = OutputWriteError(f"could not write {path}: {what}{name} [{said}]; {kept}. Fix: {fix}")
    error.errno = code  # the str() stays the message: no strerror is set
    error.path = str(path)
    return error


def write_atomic(
    path: str | os.PathLike[str], data: str | bytes, *, sync: bool = False, option: str = "--out"
) -> None:
    """Replace ``path`` with ``data`` whole: written under a temporary name beside it, then
    renamed over it. ``sync`` flushes it to the disk first (a file a resumed run reads).
    A failure removes the temporary file and raises :func:`write_error`: the old file stays."""
    target = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    with replaced(target, option=option) as temporary:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
        try:
            _write_all(fd, raw)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def replaced(path: str | os.PathLike[str], *, option: str = "--out") -> Iterator[Path]:
    """A temporary name beside ``path`` for another writer (matplotlib, a CSV writer) to write
    the file under; renamed over ``path`` when the block ends. An ``OSError`` inside, or from
    the rename, removes the temporary file and becomes :func:`write_error`."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield temporary
        os.replace(temporary, target)
    except OSError as err:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(err, OutputWriteError):  # already said, by a writer inside
            raise
        kept = "the previous file is still there, whole" if _is_file(target) else ""
        kept = kept or "nothing half-written was left"
        raise write_error(target, err, kept=kept, option=option) from err


def append(path: str | os.PathLike[str], text: str, *, option: str = "--out") -> None:
    """Add ``text`` at the end of ``path`` (made when missing). A failed append cuts the file
    back to its size before it, so it holds whole lines only, and raises :func:`write_error`."""
    target = Path(path)
    try:
        before = target.stat().st_size if target.exists() else 0
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as err:
        raise write_error(target, err, option=option) from err
    try:
        _write_all(fd, text.encode())
    except OSError as err:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, before)
        raise write_error(target, err, kept="it holds its whole lines only", option=option) from err
    finally:
        os.close(fd)


@contextlib.contextmanager
def converted(path: str | os.PathLike[str], *, option: str = "--out") -> Iterator[None]:
    """Turn an ``OSError`` inside (a writer of another library refusing) into
    :func:`write_error` for ``path``, the file or folder gpukit gave that writer."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as err:
        where = err.filename if isinstance(err.filename, str) else path
        raise write_error(where, err, kept="what it wrote before stays", option=option) from err


def make_folder(path: str | os.PathLike[str], *, option: str = "--out") -> None:
    """``mkdir -p`` whose failure is :func:`write_error` for the folder."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_error(path, err, option=option) from err


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view) :]


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False
