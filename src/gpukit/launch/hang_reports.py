"""Hang reports: which rank the others wait for, and the line where each rank is.

Every rank beats at the phase boundaries of a step (``gpukit.launch.heartbeat``). When a
rank's last beat is older than the hang timeout, the rank to blame is the one furthest behind
(smallest step, then earliest phase, then oldest beat): the others are waiting for it in a
collective. When to look, and the start-up bound of ranks that never beat, is
``gpukit.launch.hang_watch``'s; this module blames and words the report. Each rank's runner
has set ``SIGUSR1`` to write all its threads' stacks to ``stack-<rank>-<attempt>.txt`` in the
job's folder; the report shows the stuck rank's innermost
frame and its innermost frame in the user's own code (outside gpukit, torch, the standard library
and installed packages), and what every other rank waits in.

>>> watches = [Watch(0, 100.0, 5, "collective"), Watch(1, 99.0, 5, "loop")]
>>> blame(watches, now=200.0, timeout=60).rank
1
>>> blame(watches, now=120.0, timeout=60) is None
True
"""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from gpukit.launch.heartbeat import PHASES

REPORT_FILE = "hang-report.txt"


def stack_file(folder: Path, rank: int, attempt: int) -> Path:
    """Where rank ``rank`` of attempt ``attempt`` writes its stacks (the runner, which imports
    nothing from gpukit, spells the same name)."""
    return folder / f"stack-{rank}-{attempt}.txt"


@dataclass(frozen=True)
class Watch:
    """A running rank as the hang check sees it: its last beat (time, step, phase), or its
    start time, step -1 and phase "start" before its first beat; ``node``: the machine it runs
    on (named in reports of jobs on several)."""

    rank: int
    time: float
    step: int
    phase: str
    node: int = 0

    @property
    def progress(self) -> tuple[int, int]:
        """Further in the run is larger: step, then phase within it."""
        index = PHASES.index(self.phase) if self.phase in PHASES else 0
        return (self.step, index)


def blame(watches: list[Watch], now: float, timeout: float) -> Watch | None:
    """The stuck rank, once some rank has not beaten for ``timeout`` seconds; else None."""
    if not any(now - w.time > timeout for w in watches):
        return None
    return furthest_behind(watches)


def furthest_behind(watches: list[Watch]) -> Watch:
    """The rank the others wait for: smallest step, then earliest phase, then oldest beat."""
    return min(watches, key=lambda w: (w.progress, w.time, w.rank))


@dataclass(frozen=True)
class Frame:
    """One line of a stack: file, line number, function."""

    file: str
    line: int
    function: str

    def show(self) -> str:
        return f"{short_path(self.file)}:{self.line} in {self.function}"


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_dump(text: str) -> list[list[Frame]]:
    """The threads of a faulthandler dump, each innermost frame first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (found := _FRAME.match(line)):
            threads[-1].append(Frame(found[1], int(found[2]), found[3].strip()))
    return threads


def main_stack(text: str) -> list[Frame]:
    """The main thread's frames: the one that runs the program's module (faulthandler lists
    the newest thread first, so the last one when none does)."""
    threads = [t for t in parse_dump(text) if t]
    for frames in threads:
        if frames[-1].function == "<module>":
            return frames
    return threads[-1] if threads else []


def user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame in the user's code, outside gpukit, torch, the standard library,
    installed packages and Python's frozen modules."""
    roots = _library_roots()
    for frame in frames:
        if frame.file.startswith("<"):
            continue
        path = os.path.abspath(frame.file)
        if not any(path == r or path.startswith(r + os.sep) for r in roots):
            return frame
    return None


@cache
def _library_roots() -> tuple[str, ...]:
    roots = {str(Path(__file__).resolve().parents[2])}  # the gpukit package
    spec = importlib.util.find_spec("torch")  # finds it without importing it
    if spec is not None and spec.origin:
        roots.add(str(Path(spec.origin).resolve().parent))
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.abspath(path))
            roots.add(str(Path(path).resolve()))
    return tuple(sorted(roots, key=len, reverse=True))


def short_path(file: str) -> str:
    """``train.py`` (under the current folder), ``torch/distributed/...`` (installed),
    ``threading.py`` (standard library), else the path as given."""
    path = os.path.abspath(file)
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        root = sysconfig.get_paths().get(key)
        if root and path.startswith(os.path.abspath(root) + os.sep):
            return os.path.relpath(path, os.path.abspath(root))
    here = os.getcwd()
    if path.startswith(here + os.sep):
        return os.path.relpath(path, here)
    return file


def wait_for_dumps(paths: dict[int, Path], limit: float = 2.0) -> dict[int, list[Frame]]:
    """Each rank's main-thread frames, once every dump file has stopped growing (at most
    ``limit`` seconds); an empty list for a rank that wrote none."""
    deadline = time.monotonic() + limit
    last: dict[int, int] = {}
    while time.monotonic() < deadline:
        time.sleep(0.2)
        sizes = {rank: _size(path) for rank, path in paths.items()}
        if all(sizes.values()) and sizes == last:
            break
        last = sizes
    return {rank: main_stack(_read(path)) for rank, path in paths.items()}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def hang_report(
    stuck: Watch,
    watches: list[Watch],
    stacks: dict[int, list[Frame]],
    now: float,
    name: str,
    nodes: int = 1,
) -> str:
    """``NAME: rank 1 hung: no heartbeat for 20 s at step 5 (phase loop), at train.py:42 in
    main``, then what every other rank waits in; with several ``nodes``, each rank's node."""
    age, who = now - stuck.time, _label(stuck, nodes)
    if stuck.step < 0:
        head = f"{name}: {who} hung: no heartbeat in the {age:.0f} s since it started"
    else:
        head = (
            f"{name}: {who} hung: no heartbeat for {age:.0f} s at step {stuck.step} "
            f"(phase {stuck.phase})"
        )
    lines = [head + _where(stacks.get(stuck.rank, []), stuck=True)]
    return "\n".join(lines + _others([stuck], watches, stacks, now, nodes))


def startup_report(
    late: list[Watch],
    watches: list[Watch],
    stacks: dict[int, list[Frame]],
    now: float,
    name: str,
    timeout: float,
    nodes: int = 1,
) -> str:
    """``NAME: rank 1 did not start: no heartbeat in the 905 s since it started (start-up
    timeout 900 s), at train.py:3 in <module>``: the ranks that never beat (``late``, the
    first one named in the headline), where each is, then what the others wait in."""
    first, *more = sorted(late, key=lambda w: (w.time, w.rank))
    head = (
        f"{name}: {_label(first, nodes)} did not start: no heartbeat in the "
        f"{now - first.time:.0f} s since it started (start-up timeout {timeout:g} s)"
    )
    lines = [head + _where(stacks.get(first.rank, []), stuck=True)]
    for w in sorted(more, key=lambda w: w.rank):
        where = _where(stacks.get(w.rank, []), stuck=True)
        lines.append(
            f"  {_label(w, nodes)}: did not start either: no heartbeat in the "
            f"{now - w.time:.0f} s since it started{where}"
        )
    return "\n".join(lines + _others(late, watches, stacks, now, nodes))


def _label(watch: Watch, nodes: int) -> str:
    return f"rank {watch.rank}" + (f" (node {watch.node})" if nodes > 1 else "")


def _others(
    named: list[Watch],
    watches: list[Watch],
    stacks: dict[int, list[Frame]],
    now: float,
    nodes: int,
) -> list[str]:
    """One line per rank not ``named`` already: what it waits in, and its last beat."""
    lines = []
    skip = {w.rank for w in named}
    for w in sorted(watches, key=lambda w: w.rank):
        if w.rank in skip:
            continue
        beat = (
            f"last beat {now - w.time:.0f} s ago at step {w.step} (phase {w.phase})"
            if w.step >= 0
            else "no beat yet"
        )
        where = _where(stacks.get(w.rank, []), stuck=False)
        lines.append(f"  {_label(w, nodes)}:{where}; {beat}")
    return lines


def _where(frames: list[Frame], stuck: bool) -> str:
    if not frames:
        return " (no stack dump: its process did not write one)"
    inner, user = frames[0], user_frame(frames)
    if stuck:
        at = user or inner
        more = f" (innermost: {inner.show()})" if user is not None and user != inner else ""
        return f", at {at.show()}{more}"
    text = f" waits in {inner.function} ({short_path(inner.file)}:{inner.line})"
    return text + (f", called from {user.show()}" if user is not None and user != inner else "")
