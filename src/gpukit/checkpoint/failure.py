"""A checkpoint that could not be written: the reason underneath, and one error every rank
raises with it.

A failed write reaches the writer in three shapes: an ``OSError`` with its errno (the files
gpukit writes itself), a safetensors error whose text ends in ``(os error 28)``, and torch.save's
``[enforce fail at inline_container.cc:672] . unexpected pos ...`` on a full disk, which carries
no errno at all. For that last one the numbers decide: less free space than the checkpoint needs
is a full disk; a file-size limit (``ulimit -f``) below what it needs is EFBIG.

The writer notes the first failure of each rank (:class:`Failures`), skips the rest of its own
writing, and still takes part in every collective of the save, so that no rank waits for one
that gave up. At the end the ranks agree: when any failed, rank 0 removes what the save left,
words the error once, and every rank raises the same :class:`~gpukit.errors.CheckpointWriteError`.

>>> import errno
>>> errno_of(RuntimeError("I/O error: File too large (os error 27)")) == errno.EFBIG
True
>>> print(reason(errno.EROFS)[0])
the file system is read-only
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gpukit._util.files import reason as file_reason
from gpukit._util.files import size_limit
from gpukit._util.text import format_bytes
from gpukit._util.tree import tensors
from gpukit.checkpoint import lock as folder_lock
from gpukit.errors import CheckpointWriteError, ConfigError

_OS_ERROR = re.compile(r"\(os error (\d+)\)")
# What torch's zip writer says when a write came up short (it keeps no errno).
_SHORT_WRITE = re.compile(r"unexpected pos|file write failed|PytorchStreamWriter failed", re.I)
_NO_ROOM = (errnos.ENOSPC, errnos.EDQUOT)


def underlying(err: BaseException) -> BaseException:
    """The error itself: for torch.distributed.checkpoint's ``CheckpointException`` (which
    gathers every rank's failure), the first rank's.

    >>> underlying(ValueError("x")).args
    ('x',)
    """
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for _, pair in sorted(failures.items()):
            inner = pair[0] if isinstance(pair, tuple) else pair
            if isinstance(inner, BaseException):
                return inner
    return err


def errno_of(err: BaseException) -> int | None:
    """The errno under a failed write, when it says one: an ``OSError``'s, or the
    ``(os error N)`` or strerror text in safetensors' and torch's messages."""
    err = underlying(err)
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    text = str(err)
    match = _OS_ERROR.search(text)
    if match:
        return int(match.group(1))
    for code in (errnos.ENOSPC, errnos.EFBIG, errnos.EACCES, errnos.EPERM, errnos.EROFS):
        if os.strerror(code) in text:
            return code
    return None


def is_write_failure(err: BaseException) -> bool:
    """Whether ``err`` is the disk refusing a write (not a bug to show with its traceback)."""
    err = underlying(err)
    if isinstance(err, OSError):
        return True
    return errno_of(err) is not None or bool(_SHORT_WRITE.search(str(err)))


def reason(code: int | None) -> tuple[str, str]:
    """(what happened, the fix) for a write failure with errno ``code``: as any file's (see
    ``gpukit._util.files``), and a full disk may also keep fewer checkpoints."""
    what, fix = file_reason(code, "checkpoints=, --out")
    if code in _NO_ROOM:
        fix += ", or keep fewer checkpoints (keep=, --keep)"
    return what, fix


def needed_bytes(models: list[Any], optimizers: Sequence[Any]) -> int:
    """About what a checkpoint of ``models`` and ``optimizers`` takes on disk: the bytes of
    their weights, buffers and optimizer state (read locally: no collective, even sharded).

    >>> import torch
    >>> needed_bytes([torch.nn.Linear(4, 2)], [])
    40
    """
    held: list[Any] = [list(m.parameters()) + list(m.buffers()) for m in models]
    held += [list(o.state.values()) for o in optimizers]
    return sum(t.numel() * t.element_size() for t in tensors(held))


def check_room(directory: Path, needed: int) -> None:
    """A write in the background must not find the disk full half way through while training
    goes on: refused now, as the full disk it would meet (every rank raises it)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(
            errnos.ENOSPC,
            f"not enough free space for the checkpoint to be written in the background "
            f"({free} bytes free, about {needed} needed)",
        )


def message(
    err_text: str, code: int | None, directory: Path, step: int, needed: int, rank: int
) -> tuple[int | None, str]:
    """The errno (found from the numbers when the error kept none) and the words of the
    error: what failed where, the bytes needed and free, what ``latest`` still names, the
    fix."""
    try:
        free: int | None = shutil.disk_usage(
            directory if directory.exists() else directory.parent
        ).free
    except OSError:
        free = None
    if code is None and _SHORT_WRITE.search(err_text):
        # torch.save keeps no errno: the numbers tell a full disk from a file-size limit.
        limit = size_limit()
        if free is not None and free < needed:
            code = errnos.ENOSPC
        elif limit is not None and limit < needed:
            code = errnos.EFBIG
    what, fix = reason(code)
    name = f" ({errnos.errorcode[code]})" if code is not None and code in errnos.errorcode else ""
    pointer = directory / "latest"
    try:
        previous = pointer.read_text().strip() if pointer.is_file() else None
    except OSError:
        previous = None
    after = (
        f"'latest' still names {previous}, the previous checkpoint, which resuming uses"
        if previous
        else "no earlier checkpoint is there to resume from"
    )
    on = f" (rank {rank})" if rank else ""
    return code, (
        f"could not write the checkpoint of step {step} in {directory}{on}: {what}{name}; it "
        f"needs about {format_bytes(needed)} and {format_bytes(free)} are free there "
        f"[{_first_line(err_text)}]. Nothing of it was left behind and {after}. Fix: {fix}"
    )


class Failures:
    """This rank's first write failure during one save, and the ranks' agreement on them.

    >>> failures = Failures()
    >>> with failures.noted():
    ...     raise OSError(28, "No space left on device")
    >>> failures.error.errno
    28
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.agreed = True  # no rank had failed at the last agreement
        self._lock: folder_lock.FolderLock | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def busy(self) -> bool:
        """The folder is another run's: nothing of the save was written, nothing to clean."""
        return isinstance(self.error, ConfigError)

    def hold(self, directory: Path) -> None:
        """Hold ``directory``'s lock for this save (a ConfigError, noted, when another run
        holds it); ``release`` gives it back."""
        try:
            self._lock = folder_lock.hold(
                directory,
                command=folder_lock.this_program(),
                fix="wait for it, or save into another folder",
            )
        except ConfigError as err:
            if isinstance(err.__cause__, OSError):  # the disk refused: a write failure
                raise err.__cause__ from None
            raise

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @contextlib.contextmanager
    def noted(self) -> Iterator[None]:
        """Note a write failure inside (the first one counts); anything else propagates."""
        try:
            yield
        except BaseException as err:  # torch.distributed.checkpoint's errors are BaseExceptions
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            if not is_write_failure(err) and not isinstance(err, ConfigError):
                raise
            if self.error is None:
                self.error = err

    def agree(self, strategy: Any) -> list[tuple[int, int | None, str, bool]]:
        """Every rank's failure so far, as (rank, errno, text, busy), rank order
        (collective)."""
        mine = None
        if self.error is not None:
            text = str(underlying(self.error))
            mine = (None if self.busy else errno_of(self.error), text, self.busy)
        found = [
            (rank, *entry)
            for rank, entry in enumerate(strategy.all_gather_object(mine))
            if entry is not None
        ]
        self.agreed = not found
        return found


def raise_agreed(
    found: list[tuple[int, int | None, str, bool]],
    own: BaseException | None,
    strategy: Any,
    directory: Path,
    step: int,
    needed: int,
) -> None:
    """Raise on every rank the one error for the first failure found (collective; rank 0 has
    already removed what the save left). ``needed`` counts on rank 0 only. A folder another
    run holds is the ConfigError that said so, on every rank."""
    rank, code, text, busy = found[0]
    if busy:
        raise ConfigError(text) from own
    said = message(text, code, directory, step, needed, rank) if strategy.rank == 0 else None
    code, words = strategy.broadcast_object(said, 0)
    error = CheckpointWriteError(words)
    error.errno = code  # the str() stays the message: no strerror is set
    raise error from own


def clean_up(directory: Path, tmp: Path) -> None:
    """Remove what a failed save left in ``directory``: its temporary folder and a half
    written ``latest``; the checkpoints and ``latest`` itself stay as they were."""
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(OSError):
        (directory / ".tmp-latest").unlink()


def _first_line(text: str, width: int = 120) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."
