"""A ``gpukit train --out DIR`` folder read back whole, for ``gpukit report``: what the run
wrote (``metrics.json``, ``metrics.csv``, ``config.toml``, ``checkpoints/``), what gpukit's
launcher recorded beside it (``ranks.jsonl``: samples of every rank; ``events.jsonl``:
stragglers, restarts, hangs, the end), and any trace or profile files found there.

The folder may belong to a run still going, or to one that died: every file is optional, and
a line of a ``.jsonl`` file that does not parse (the last one, half-written by a process that
was killed) is skipped and counted, never fatal. Only a folder that holds none of the run's
files is refused.

>>> import tempfile
>>> folder = Path(tempfile.mkdtemp())
>>> _ = (folder / "events.jsonl").write_text('{"time": 1.0, "kind": "restart"}\\n{"time": 2\\n')
>>> run = read_run(folder)
>>> [e["kind"] for e in run.events], run.skipped
(['restart'], {'events.jsonl': 1})
"""

from __future__ import annotations

import csv
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpukit.checkpoint import lock as folder_lock
from gpukit.checkpoint.files import LATEST
from gpukit.errors import ConfigError, Preempted

# The files that make a folder a run's: any one of them is enough to report on.
RUN_FILES = ("metrics.json", "metrics.csv", "config.toml", "ranks.jsonl", "events.jsonl")
# What a run's exit code says, for the headline (gpukit.cli.__main__'s codes).
HOW_ENDED = {0: "finished", 143: "stopped", 130: "stopped"}
# Trace and profile files: ``gpukit trace --out``'s JSON, ``rt.profile``'s windows and tables.
PROFILE_PATTERNS = ("*.pt.trace.json", "*summary.txt", "trace*.json")


# What an exit code of gpukit train says of the run (gpukit.cli.__main__'s codes).
ENDED = {
    0: "finished",
    143: "stopped on request (SIGTERM or Ctrl-C), after saving",
    130: "stopped at once by a second Ctrl-C",
    2: "failed: a rank refused its input (exit code 2)",
    1: "failed or hung (exit code 1)",
}


@dataclass(frozen=True)
class Ended:
    """How a run ended, as the process that ran it knows: its exit ``code`` and in words.

    >>> Ended.of_code(143).how
    'stopped on request (SIGTERM or Ctrl-C), after saving'
    >>> Ended.of_error(RuntimeError("boom"))
    Ended(code=1, how='failed: boom')
    """

    code: int
    how: str

    @classmethod
    def of_code(cls, code: int) -> Ended:
        """A run that returned exit ``code``."""
        return cls(code, ENDED.get(code, f"failed (exit code {code})"))

    @classmethod
    def of_error(cls, err: BaseException) -> Ended:
        """A run that raised ``err``."""
        if isinstance(err, Preempted):
            return cls.of_code(143)
        if isinstance(err, KeyboardInterrupt):
            return cls(130, "stopped by Ctrl-C")
        said = str(err).splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return cls(1, f"failed: {said}")


@dataclass
class RunRecords:
    """Everything a run's folder holds, read once; None or empty where a file is missing.
    ``skipped`` counts the lines of each ``.jsonl`` file that did not parse; ``notes`` says
    what could not be read and why."""

    folder: Path
    metrics: dict[str, Any] | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    settings: dict[str, Any] | None = None  # config.toml
    samples: list[dict[str, Any]] = field(default_factory=list)  # ranks.jsonl
    events: list[dict[str, Any]] = field(default_factory=list)  # events.jsonl
    checkpoints: list[str] = field(default_factory=list)
    profiles: list[Path] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    status: str = "unknown"  # finished | running | failed | stopped
    status_why: str = ""

    @property
    def workload(self) -> str | None:
        """The workload's name, from metrics.json or config.toml."""
        for source in (self.metrics, self.settings):
            if source and source.get("workload"):
                return str(source["workload"])
        return None

    @property
    def ranks(self) -> list[int]:
        """Every rank ranks.jsonl has a sample of, sorted.

        >>> RunRecords(Path("."), samples=[{"ranks": [{"rank": 1}, {"rank": 0}]}]).ranks
        [0, 1]
        """
        return sorted({int(r["rank"]) for s in self.samples for r in s["ranks"]})


def read_run(folder: str | os.PathLike[str], ended: Ended | None = None) -> RunRecords:
    """The records of the run in ``folder``. ``ended``: how it ended, when the caller ran it
    (``gpukit train`` writing its own report); else the status is read from the folder.
    ConfigError for a folder that is missing or holds none of :data:`RUN_FILES`."""
    path = Path(folder)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise ConfigError(
            f"{folder} {what}: give the folder a run wrote (gpukit train --out DIR), e.g. "
            "gpukit report runs/mlp"
        )
    if not any((path / name).is_file() for name in RUN_FILES):
        raise ConfigError(
            f"{folder} is not a run's folder: it holds none of {', '.join(RUN_FILES)}. Give "
            "the folder of a gpukit train --out DIR run"
        )
    run = RunRecords(folder=path)
    run.metrics = _json_file(path / "metrics.json", run)
    run.history = _history(path / "metrics.csv", run)
    run.settings = _toml_file(path / "config.toml", run)
    run.samples = [s for s in _json_lines(path / "ranks.jsonl", run) if _is_sample(s)]
    run.events = _json_lines(path / "events.jsonl", run)
    run.checkpoints = _checkpoints(path / "checkpoints")
    run.profiles = _profiles(path)
    run.status, run.status_why = _status(run, ended)
    return run


def _json_file(path: Path, run: RunRecords) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        run.notes.append(f"{path.name} could not be read ({err}): left out")
        return None
    return data if isinstance(data, dict) else None


def _toml_file(path: Path, run: RunRecords) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return _toml().loads(path.read_text())
    except (OSError, ValueError, ImportError) as err:
        run.notes.append(f"{path.name} could not be read ({err}): left out")
        return None


def _toml() -> Any:
    """tomllib (Python 3.11+), else tomli, which gpukit requires on Python 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # type: ignore[import-not-found, unused-ignore]

    return tomli


def _history(path: Path, run: RunRecords) -> list[dict[str, float]]:
    """metrics.csv's rows as numbers; a row that is not (a half-written last line) skipped."""
    if not path.is_file():
        return []
    rows: list[dict[str, float]] = []
    bad = 0
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    record = {k: float(v) for k, v in row.items() if k and v not in ("", None)}
                except (TypeError, ValueError):
                    bad += 1
                    continue
                if "step" in record:
                    rows.append(record)
                else:
                    bad += 1
    except OSError as err:
        run.notes.append(f"{path.name} could not be read ({err}): left out")
    if bad:
        run.skipped[path.name] = bad
    return rows


def _json_lines(path: Path, run: RunRecords) -> list[dict[str, Any]]:
    """One JSON object a line; lines that are not one are counted in ``run.skipped``."""
    if not path.is_file():
        return []
    found: list[dict[str, Any]] = []
    bad = 0
    try:
        text = path.read_text(errors="replace")
    except OSError as err:
        run.notes.append(f"{path.name} could not be read ({err}): left out")
        return []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(record, dict):
            found.append(record)
        else:
            bad += 1
    if bad:
        run.skipped[path.name] = bad
    return found


def _is_sample(sample: dict[str, Any]) -> bool:
    """A ranks.jsonl record with a time and a list of ranks, each with its rank number."""
    ranks = sample.get("ranks")
    return (
        isinstance(sample.get("time"), (int, float))
        and isinstance(ranks, list)
        and all(isinstance(r, dict) and isinstance(r.get("rank"), int) for r in ranks)
    )


def _checkpoints(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))


def _profiles(folder: Path) -> list[Path]:
    """Trace and profile files in the folder and the folders just under it (checkpoints
    left out: they hold no such file, and may hold many folders)."""
    places = [folder] + [
        p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith("checkpoints")
    ]
    found: set[Path] = set()
    for place in places:
        for pattern in PROFILE_PATTERNS:
            found.update(p for p in place.glob(pattern) if p.is_file())
    return sorted(found)


def _status(run: RunRecords, ended: Ended | None) -> tuple[str, str]:
    """(finished | running | failed | stopped, why it is said)."""
    if ended is not None:
        return _from_code(ended.code), ended.how
    # A live process holding the folder runs now, whatever the records' last end says: that
    # is an earlier run's, one this run resumes (they append to the same events.jsonl).
    holder = folder_lock.holder(run.folder)
    if holder is not None and holder.host == socket.gethostname() and _alive(holder.pid):
        return "running", f"{holder.describe()} holds the folder"
    last = next((e for e in reversed(run.events) if e.get("kind") == "ended"), None)
    if last is not None and isinstance(last.get("code"), int):
        code = last["code"]
        return _from_code(code), str(last.get("text") or f"the launcher recorded exit code {code}")
    if last is not None:  # an end without its code: metrics.json says whether it finished
        status = "finished" if run.metrics is not None else "failed"
        return status, str(last.get("text") or "the launcher recorded the job's end")
    holder = folder_lock.holder(run.folder)
    if holder is not None:
        if holder.host != socket.gethostname():
            return "running", f"{holder.describe()} holds the folder (another host: not checked)"
        if _alive(holder.pid):
            return "running", f"{holder.describe()} holds the folder"
        return "failed", f"{holder.describe()} held the folder and is gone: killed or crashed"
    if run.metrics is not None:
        return "finished", "metrics.json was written at the end of the run"
    return "failed", "no metrics.json and no process holds the folder: it ended before its end"


def _from_code(code: object) -> str:
    return HOW_ENDED.get(code, "failed") if isinstance(code, int) else "failed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    return True


def newest_checkpoint(run: RunRecords) -> str | None:
    """The name the checkpoints' ``latest`` file gives, else the last ``step-*`` folder."""
    latest = run.folder / "checkpoints" / LATEST
    try:
        return latest.read_text().strip() or None
    except OSError:
        return run.checkpoints[-1] if run.checkpoints else None
