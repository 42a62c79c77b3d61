"""The ``--out`` folder of ``gpukit train``, claimed and checked before anything starts.

A run writes its metrics, plot and checkpoints there at the end of an epoch or of the run;
a folder it cannot write, or one holding another run's checkpoints, would fail or do harm
only then. :func:`check_out` refuses those at once, and changes nothing on disk when it does.
:func:`claim_out` locks the folder first (one run per folder, see
``gpukit.checkpoint.lock``): a second run into it is refused, naming the one there.

>>> check_out(None, resume=False, overwrite=False) is None
True
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gpukit.checkpoint import lock as folder_lock
from gpukit.checkpoint.files import LATEST, has_checkpoints, newest_step
from gpukit.errors import ConfigError, warn_user

CHECKPOINTS = "checkpoints"


def claim_out(out: str | None, command: str = "gpukit train") -> folder_lock.FolderLock | None:
    """Lock the ``--out`` folder for this run (created when missing; the lock's ``release``
    removes it again if the run left it empty); None without ``--out``. ConfigError when
    another run holds it: ``runs/x is in use by pid 1234 on host h since 2026-11-25 23:50:01
    (gpukit train): wait for it, stop it, or use another --out``.

    >>> claim_out(None) is None
    True
    """
    if out is None:
        return None
    return folder_lock.hold(
        _valid(out), command=command, fix="wait for it, stop it, or use another --out"
    )


def _valid(out: str) -> Path:
    """``--out`` as a folder path: a name that is not blank and not a file."""
    if not out.strip():
        raise ConfigError(
            f"--out {out!r}: give a folder (--out runs/mlp), or leave --out out to write no "
            "metrics and no checkpoints"
        )
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"--out {out}: that is a file, not a folder: give a folder for the metrics, plot "
            "and checkpoints (a new one is created), or remove the file"
        )
    return path


def check_out(out: str | None, *, resume: bool, overwrite: bool) -> Path | None:
    """The run's output folder, once it is known to be usable; None without ``--out``.

    Refused (ConfigError, with nothing created or changed): an empty name; an existing file;
    a folder that cannot be created or written; a folder whose ``checkpoints/`` holds
    checkpoints when neither ``resume`` (continue them) nor ``overwrite`` (start over) is
    given. With ``overwrite``, once every check passed, the old ``checkpoints/`` is renamed to
    ``checkpoints.old-<date>-<time>/`` beside it: nothing on disk is deleted.

    >>> check_out("  ", resume=False, overwrite=False)
    Traceback (most recent call last):
    gpukit.errors.ConfigError: --out '  ': give a folder (--out runs/mlp), or leave --out out ...
    """
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict: continue, or start over")
    if out is None:
        return None
    path = _valid(out)
    checkpoints = path / CHECKPOINTS
    if checkpoints.exists() and not checkpoints.is_dir():
        raise ConfigError(
            f"--out {out}: {checkpoints} is a file, where the checkpoints folder goes: remove "
            "it, or give another --out"
        )
    held = has_checkpoints(checkpoints)
    if held and not resume and not overwrite:
        step = newest_step(checkpoints)
        upto = f"up to step {step}" if step is not None else f"(a '{LATEST}' file)"
        raise ConfigError(
            f"--out {out} already holds checkpoints {upto} in {checkpoints}: add --resume to "
            "continue that run, or --overwrite to start over (the old checkpoints are kept, "
            f"renamed to {CHECKPOINTS}.old-<date>-<time>), or give another --out"
        )
    _check_writable(path, out)
    if checkpoints.is_dir():
        _check_writable(checkpoints, out)
    if held and overwrite:
        moved = move_aside(checkpoints)
        warn_user(f"--overwrite: the checkpoints of the previous run were moved to {moved}")
    return path


def move_aside(checkpoints: Path) -> Path:
    """Move what ``checkpoints`` holds into ``checkpoints.old-<date>-<time>`` beside it (a
    number is added when that name is taken); returns the new folder. A lock file stays (the
    folder is renamed when there is none): this run holds it, on the folder it goes on
    writing."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = checkpoints.with_name(f"{checkpoints.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = checkpoints.with_name(f"{checkpoints.name}.old-{stamp}-{n}")
    if not (checkpoints / folder_lock.LOCK_FILE).exists():
        os.rename(checkpoints, target)
        return target
    target.mkdir()
    for entry in checkpoints.iterdir():
        if entry.name != folder_lock.LOCK_FILE:
            os.rename(entry, target / entry.name)
    return target


def _check_writable(path: Path, out: str) -> None:
    """Create ``path`` (and its missing parents), write and remove a small file in it, and
    remove again what was created: the folder the run will write is known to work, and the
    disk is as it was."""
    created: list[Path] = []
    probe = path / f".gpukit-write-check-{os.getpid()}"
    try:
        for folder in reversed([path, *path.parents]):
            if not folder.exists():
                folder.mkdir()
                created.append(folder)
        probe.write_bytes(b"gpukit")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"--out {out}: cannot write there ({err.strerror or type(err).__name__}: "
            f"{err.filename or path}): give a folder you can write, or fix its permissions"
        ) from None
    finally:
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                warn_user(f"--out {out}: could not remove {folder}, created to check the path")


def complete_message(
    out: str | None, step: int, total: int, epochs: int, max_steps: int | None
) -> str:
    """What ``--resume`` says of a run whose newest checkpoint is at ``step`` when ``total``
    steps (``epochs``, capped by ``max_steps``) were asked for: nothing to train, and how to
    train further or start over.

    >>> complete_message("runs/mlp", 50, 50, 3, 50).split(": ")[0]
    'the run in runs/mlp is already complete'
    """
    asked = f"--max-steps {max_steps}" if max_steps == total else f"{epochs} epoch(s)"
    where = f"of the {total}" if step == total else f"past the {total}"
    further = f"--max-steps (e.g. --max-steps {2 * max(step, 1)}) or --epochs"
    return (
        f"the run in {out} is already complete: its newest checkpoint is at step {step} "
        f"{where} steps asked for ({asked}), so there is nothing to train; {out} is left as "
        f"it was. To train further, raise {further}; to start over, --overwrite."
    )
