"""A written checkpoint made the one to resume from: its files fsynced, ``manifest.json``
written last, the folder renamed into place, ``latest`` pointed at it and the old ones pruned;
or, when it holds NaN or Inf, kept aside with ``latest`` left on the last good one. Used by a
synchronous save and by a background one alike (see ``writer``, ``background``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from gpukit.checkpoint import files
from gpukit.checkpoint import lock as folder_lock
from gpukit.errors import warn_user


def finish(
    directory: Path, final: Path, step: int, bad: list[str], known: dict[str, Any], keep: int
) -> None:
    """Rank 0, the files written: fsync them, write the manifest last, and publish (or keep
    aside a checkpoint with non-finite values)."""
    tmp = directory / f".tmp-{final.name}"
    for f in sorted(tmp.rglob("*"), reverse=True):  # files, then the folders in them
        if f.relative_to(tmp).as_posix() not in known:
            files.fsync(f)
    files.write_manifest(tmp, step, bad, known)  # last: means complete
    files.fsync(tmp)
    if bad:
        _keep_bad(directory, tmp, final, bad)
    else:
        _publish(directory, tmp, final, keep)


def _publish(directory: Path, tmp: Path, final: Path, keep: int) -> None:
    """Move a good checkpoint into place, point ``latest`` at it, prune."""
    later = files.newest_step(directory)
    step = files.step_of(final) or 0
    old = directory / f".old-{final.name}"
    if final.exists():  # the same step saved again: swap, so `latest` never dangles long
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    try:
        files.point_latest(directory, final)
    except OSError:
        # `latest` could not be written (a full disk): not published after all. The new one
        # goes back where the failed save's leftovers are removed, the one it replaced returns.
        os.replace(final, tmp)
        if old.is_dir():
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
    files.fsync(directory)
    files.prune(directory, keep, final, leftovers=folder_lock.held_here(directory))
    if later is not None and later > step:
        warn_user(
            f"{directory} also holds checkpoints of later steps (up to step {later}): "
            f"'{files.LATEST}' now names {final.name}, and pruning keeps the highest steps, "
            "so this run keeps only its newest checkpoint; give each run its own folder"
        )


def _keep_bad(directory: Path, tmp: Path, final: Path, bad: list[str]) -> None:
    """Keep a checkpoint with non-finite values aside from the good ones: never over an
    existing folder, never named by ``latest``, and nothing pruned for it."""
    found = "; ".join(bad[:3]) + (f"; and {len(bad) - 3} more" if len(bad) > 3 else "")
    pointer = directory / files.LATEST
    good = pointer.read_text().strip() if pointer.is_file() else None
    after = (
        f"'{files.LATEST}' still names {good}, the last good one, which resuming uses"
        if good
        else f"no '{files.LATEST}' was written, so there is nothing to resume from yet"
    )
    if final.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        warn_user(
            f"the checkpoint of step {files.step_of(final)} holds non-finite values ({found}); "
            f"it was not written over {final}, which stays as it was; {after}"
        )
        return
    os.replace(tmp, final)
    files.fsync(directory)
    warn_user(
        f"checkpoint {final} holds non-finite values ({found}): it is kept for inspection, "
        f"marked bad in its {files.MANIFEST}, and {after}"
    )
