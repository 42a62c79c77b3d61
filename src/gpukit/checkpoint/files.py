"""The files of a checkpoint on disk: manifests and checksums, which folder to resume from,
and pruning.

A checkpoint folder ``step-NNNNNNNN/`` holds its files and, written last, ``manifest.json``:
the format, the step, whether every saved value was finite, and each file's size and sha256
(files in sub-folders, such as the shards of a sharded checkpoint, by their relative path).
A folder is *good* when every file matches its manifest and nothing in it was marked bad.
Folders written before manifests existed (format 1) cannot be verified and count as good when
their files are there.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     print(has_checkpoints(tmp), resumable(tmp))
False None
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from gpukit.errors import ConfigError, warn_user

FORMAT = 2  # 2: folders with a manifest; 1: the same files, without one
LATEST = "latest"
MANIFEST = "manifest.json"
STATE = "state.pt"
_STEP = re.compile(r"^(?:\.old-)?step-(\d+)$")
_LEFTOVER = (".tmp-step-", ".deleting-")  # a save or a prune that was cut short


def folder(call: str, given: Any, default: Path | None) -> Path:
    """The checkpoint folder ``call`` (``rt.save``, ``rt.load``) was given, or the Runtime's,
    checked.

    >>> folder("rt.save", None, Path("ckpt")).name
    'ckpt'
    """
    chosen = given if given is not None else default
    if chosen is None:
        raise ConfigError(f"{call}() needs a folder: {call}('ckpt'), or Runtime(checkpoints=...)")
    if not isinstance(chosen, (str, os.PathLike)) or not str(chosen).strip():
        raise ConfigError(f"{call}({chosen!r}): give the checkpoint folder as a path, e.g. 'ckpt'")
    return Path(chosen)


def folder_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``.

    >>> folder_name(12)
    'step-00000012'
    """
    return f"step-{step:08d}"


def step_of(folder: Path) -> int | None:
    """The step in a checkpoint folder's name; None for any other name."""
    match = _STEP.match(folder.name)
    return int(match.group(1)) if match else None


def sha256(path: Path) -> str:
    """The sha256 of a file, read in pieces (a checkpoint can be larger than memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def describe(folder: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size, sha256) of ``paths`` inside ``folder``, by relative path; each
    file fsynced first."""
    entries = {}
    for f in paths:
        fsync(f)
        entries[f.relative_to(folder).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
    return entries


def write_manifest(
    folder: Path, step: int, problems: list[str], known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write ``folder/manifest.json`` for the files already in ``folder`` (the last file of a
    save); ``problems`` are the non-finite values found, which mark the checkpoint bad.
    ``known``: entries already made (each rank describes the shards it wrote)."""
    known = known or {}
    files = {  # the files in sub-folders too (every rank's shards): by their relative path
        name: known[name] if name in known else describe(folder, [f])[name]
        for f in sorted(folder.rglob("*"))
        if f.is_file() and (name := f.relative_to(folder).as_posix()) != MANIFEST
    }
    manifest = {
        "format": FORMAT,
        "step": step,
        "finite": not problems,
        "problems": problems,
        "files": files,
    }
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    fsync(path)
    return manifest


def is_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` is one checkpoint (rather than a directory of them)."""
    return (folder / MANIFEST).is_file() or (folder / STATE).is_file()


def problem(folder: Path) -> str | None:
    """Why the checkpoint ``folder`` cannot be resumed from, as words that follow its name
    ("is damaged: ..."); None when it is good. Reads every file once to check its sha256."""
    if not folder.is_dir():
        return "is missing (no such folder)"
    path = folder / MANIFEST
    if not path.is_file():
        if not (folder / STATE).is_file():
            return f"is incomplete (no {MANIFEST}, no {STATE})"
        if not any(folder.glob("model*.safetensors")):
            return "is incomplete (no model*.safetensors)"
        return None  # format 1, written before manifests: nothing to verify against
    try:
        manifest = json.loads(path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"is damaged: its {MANIFEST} cannot be read ({type(err).__name__})"
    if manifest.get("format") != FORMAT:
        return f"has format {manifest.get('format')!r}, which this gpukit cannot read"
    for name, entry in files.items():
        file = folder / name
        if not file.is_file():
            return f"is incomplete: {name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"is damaged: {name} has {size} bytes, {entry['bytes']} were written"
        if sha256(file) != entry["sha256"]:
            return f"is damaged: {name} does not match the checksum written with it"
    if not manifest.get("finite", True):
        found = "; ".join(manifest.get("problems", [])[:3])
        return f"was marked bad when saved (non-finite values: {found})"
    return None


def has_checkpoints(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds any checkpoint: a ``step-*`` folder or a ``latest`` file.

    >>> has_checkpoints("/no/such/folder")
    False
    """
    directory = Path(directory)
    if (directory / LATEST).exists():
        return True
    return directory.is_dir() and any(p.is_dir() for p in directory.glob("step-*"))


def newest_step(directory: str | os.PathLike[str]) -> int | None:
    """The highest step among the checkpoint folders in ``directory``; None when there is none."""
    steps = [step_of(p) for p in _folders(Path(directory))]
    return max((s for s in steps if s is not None), default=None)


def latest(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint to resume from: ``directory`` itself when it is one checkpoint folder,
    else the folder its ``latest`` file names when that one is good, else (with a warning that
    names both) the newest good folder there. ConfigError when there is none.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     latest(tmp)
    Traceback (most recent call last):
    gpukit.errors.ConfigError: no checkpoint in ... (no 'latest' file there): ...
    """
    directory = Path(directory)
    if is_checkpoint(directory):
        reason = problem(directory)
        if reason is not None:
            raise ConfigError(damaged_message(directory, reason))
        return directory
    pointer = directory / LATEST
    text = _pointer_text(pointer)
    named = _inside(directory, text) if text is not None else None
    if text is not None and named is None:
        return _instead_of_outside(directory, pointer, text)
    reason = problem(named) if named is not None else None
    if named is not None and reason is None:
        return named
    good, refused = newest_good(directory, besides=named)
    if good is None:
        if named is None and not refused:
            raise ConfigError(
                f"no checkpoint in {directory} (no '{LATEST}' file there): check the path, or "
                "run once without resuming to create one"
            )
        why = [f"{named.name} (named by {pointer}) {reason}"] if named is not None else []
        why += [f"{p.name} {r}" for p, r in refused[:3]]
        raise ConfigError(
            f"no checkpoint in {directory} can be resumed from: {'; '.join(why)}. Nothing "
            "was changed: start without resuming, in a new folder"
        )
    if named is None:
        warn_user(
            f"no '{LATEST}' file in {directory}: resuming from {good.name}, the newest good "
            "checkpoint there"
        )
    else:
        warn_user(
            f"checkpoint {named} named by {pointer} {reason}: resuming from {good.name}, the "
            "newest good checkpoint there, instead"
        )
    return good


def _pointer_text(pointer: Path) -> str | None:
    """What the ``latest`` file says (stripped); None when there is no such file."""
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""  # unreadable: names no folder, which _inside refuses


def _inside(directory: Path, name: str) -> Path | None:
    """``directory/name`` when ``name`` is one folder name inside ``directory`` (as the writer
    writes it), also once links are followed; None for anything else: '..', a path, an
    absolute path, a link out. A run never loads state from outside its checkpoint folder."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return None
    folder = directory / name
    if folder.resolve().parent != directory.resolve():
        return None
    return folder


def _instead_of_outside(directory: Path, pointer: Path, text: str) -> Path:
    """The newest good checkpoint in ``directory``, with a warning that the ``latest`` file,
    which names something outside it, was ignored; ConfigError when there is none."""
    why = (
        f"{pointer} names {text!r}, which is not a checkpoint folder inside {directory}"
        if text
        else f"{pointer} names no folder"
    )
    good, refused = newest_good(directory)
    if good is None:
        found = "".join(f"; {p.name} {r}" for p, r in refused[:3])
        raise ConfigError(
            f"no checkpoint in {directory} can be resumed from: {why} (ignored: a checkpoint "
            f"is only loaded from its own folder){found}. Nothing was changed: start without "
            "resuming, in a new folder"
        )
    warn_user(
        f"{why}: ignored (a checkpoint is only loaded from its own folder); resuming from "
        f"{good.name}, the newest good checkpoint there, instead"
    )
    return good


def resumable(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint a run in ``directory`` resumes from (see :func:`latest`); None when
    ``directory`` holds no checkpoint at all. ConfigError when it holds some but none is good.

    >>> resumable("/no/such/folder") is None
    True
    """
    if not has_checkpoints(directory) and not is_checkpoint(Path(directory)):
        return None
    return latest(directory)


def newest_good(
    directory: Path, besides: Path | None = None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest good checkpoint folder in ``directory`` other than ``besides``, and the
    newer ones passed over with why."""
    refused: list[tuple[Path, str]] = []
    for folder in sorted(_folders(directory), key=_order, reverse=True):
        if besides is not None and folder.name == besides.name:
            continue
        reason = problem(folder)
        if reason is None:
            return folder, refused
        refused.append((folder, reason))
    return None, refused


def damaged_message(folder: Path, reason: str) -> str:
    """A ConfigError's text for a checkpoint that cannot be used: why, that nothing was
    changed, and the good checkpoint beside it to use instead, if any."""
    return f"checkpoint {folder} {reason}. Nothing was changed; {alternative(folder)}"


def alternative(folder: Path) -> str:
    """Words naming the newest good checkpoint beside ``folder`` and how to resume from it."""
    good, _ = newest_good(folder.parent, besides=folder)
    if good is None:
        return "no other checkpoint beside it is good: start without resuming"
    return (
        f"the newest good checkpoint there is {good}: load it with rt.load('{good}'), or "
        f"write '{good.name}' into {folder.parent / LATEST} so that resuming uses it"
    )


def point_latest(directory: Path, folder: Path) -> None:
    """Make ``directory/latest`` name ``folder``, atomically (a new file renamed over it)."""
    path = directory / LATEST
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(folder.name + "\n")
    fsync(tmp)
    os.replace(tmp, path)


def ordinary_mode(path: Path) -> None:
    """Give ``path`` the permissions of a file ``open()`` creates (0666 less the umask), as
    every other file of a checkpoint has: safetensors writes its files readable by their
    owner alone (0600)."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask: read from /proc where there is one, since setting it to read
    it back would race with threads creating files meanwhile."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(directory: Path, keep: int, saved: Path, leftovers: bool = True) -> None:
    """Remove the checkpoints beyond the newest ``keep`` (by step), never ``saved`` (the good
    one just written, which ``latest`` names), and, with ``leftovers``, what saves and prunes
    cut short left (``.tmp-step-*``, ``.deleting-*``, swapped ``.old-step-*``).

    Only gpukit's checkpoints are removed: a ``step-*`` folder holding neither a manifest nor
    a ``state.pt`` is someone else's and stays. ``leftovers`` is for a writer that holds the
    folder's lock (``gpukit.checkpoint.lock``): only then can no other live run be writing
    a ``.tmp-step-*`` there."""
    folders = sorted(_folders(directory), key=_order)
    for old in folders[:-keep]:
        if old.name != saved.name and is_checkpoint(old):
            remove(old)
    if not leftovers:
        return
    for leftover in directory.iterdir():
        swapped = leftover.name.startswith(".old-") and (directory / leftover.name[5:]).is_dir()
        if leftover.is_dir() and (swapped or leftover.name.startswith(_LEFTOVER)):
            shutil.rmtree(leftover, ignore_errors=True)


def remove(folder: Path) -> None:
    """Delete a checkpoint folder so that no half-deleted one is left under its name: it is
    renamed first, then deleted."""
    doomed = folder.with_name(f".deleting-{folder.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _folders(directory: Path) -> list[Path]:
    """The checkpoint folders in ``directory``: ``step-*``, and ``.old-step-*`` whose
    ``step-*`` is gone (a save of the same step swapped them and was cut short); never a link
    to a folder elsewhere."""
    if not directory.is_dir():
        return []
    return [
        p
        for p in directory.iterdir()
        if _STEP.match(p.name)
        and p.is_dir()
        and not (p.name.startswith(".old-") and (directory / p.name[5:]).exists())
        and _inside(directory, p.name) is not None
    ]


def _order(folder: Path) -> tuple[int, bool]:
    return step_of(folder) or 0, not folder.name.startswith(".old-")
