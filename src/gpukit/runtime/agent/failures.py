"""How each rank of an attempt ended, and the headline that names the rank that failed first.

A rank fails by raising (the runner records the error with a nanosecond clock), by exiting with
a non-zero code, or by being killed by a signal (its waiting thread notes the nanosecond it
ended). Its failure time is the earlier of the two. When one rank dies, its peers usually fail
too, a moment later, on the broken connection ("Connection closed by peer", "Broken pipe",
NCCL's "remote process exited"): those errors are consequences, ranked after every failure that
is not one, whatever their times. Ranks the launcher killed after the first failure are
"stopped", not failed.

>>> ends = [
...     RankEnd(0, 1, 2_000, ErrorRecord("RuntimeError: Connection closed by peer", 1_900)),
...     RankEnd(1, -9, 1_000, step=6, phase="backward"),
... ]
>>> print(headline(ends, "gpukit launch"))
gpukit launch: rank 1 was killed by SIGKILL at step 6 (phase backward) — the first failure;
  rank 0 failed after it
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import dataclass
from pathlib import Path

# Errors that say a peer went away, not why: a rank that fails with one is a victim.
_CONSEQUENCE = re.compile(
    r"connection (?:closed|reset) by peer|broken pipe|remote process exited|connectfullmesh"
    r"|connection refused|the connection to another rank|communicator was aborted"
    r"|nccl.*(?:abort|remote)|socket closed",
    re.IGNORECASE,
)
PREEMPTED_EXIT = 143  # what gpukit's Preempted exits with, as a process ended by SIGTERM


@dataclass(frozen=True)
class ErrorRecord:
    """The error a rank's runner recorded: ``"ValueError: bad shape"`` and when; for bad
    input (a gpukit ``ConfigError`` and the like, exit code 2), the message alone and where
    the script raised it (``"train.py:12"``; None for gpukit's own commands)."""

    message: str
    time_ns: int | None = None
    bad_input: str | None = None
    where: str | None = None

    @property
    def first_line(self) -> str:
        return first_line(self.message)


def read_error(path: Path) -> ErrorRecord | None:
    """The error recorded in torchrun's format at ``path`` (None: none, or unreadable)."""
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        text = message.get("message", "") if isinstance(message, dict) else str(message)
        when = extra.get("time_ns")
        bad, where = extra.get("bad_input"), extra.get("where")
        return ErrorRecord(
            str(text),
            int(when) if when is not None else None,
            str(bad) if bad is not None else None,
            str(where) if where is not None else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class Fault:
    """What went wrong in one attempt, compared across attempts to see a crash loop."""

    kind: str  # "raised", "exited", "killed" or "hung"
    rank: int
    message: str  # its first line
    step: int | None
    text: str  # "rank 1 was killed by SIGKILL at step 6 (phase backward)"
    attempt: int = 0

    def same_as(self, other: Fault) -> bool:
        """The same failure: same kind, rank, first line of the message and step."""
        mine = (self.kind, self.rank, self.message, self.step)
        return mine == (other.kind, other.rank, other.message, other.step)


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended: its exit code (negative: a signal), when, what it recorded, and
    where its heartbeat last was."""

    rank: int
    code: int
    ended_ns: int
    error: ErrorRecord | None = None
    stopped: bool = False  # killed by the launcher after another rank failed or hung
    step: int | None = None
    phase: str | None = None
    asked_to_stop: bool = False  # the launcher sent it SIGTERM (a preemption it forwarded)

    @property
    def preempted(self) -> bool:
        """It stopped because it was asked to (and saved), not because it broke; a script
        without a SIGTERM handler that the launcher's SIGTERM ended counts too."""
        recorded = self.error is not None and self.error.message.startswith("Preempted")
        obeyed = self.asked_to_stop and self.code == -signal.SIGTERM
        return self.code == PREEMPTED_EXIT or recorded or obeyed

    @property
    def failed(self) -> bool:
        return self.code != 0 and not self.stopped and not self.preempted

    @property
    def consequence(self) -> bool:
        """Its error only says a peer went away."""
        return self.error is not None and is_consequence(self.error.message)

    @property
    def failed_at_ns(self) -> int:
        recorded = self.error.time_ns if self.error is not None else None
        return min(self.ended_ns, recorded) if recorded is not None else self.ended_ns

    @property
    def kind(self) -> str:
        if self.error is not None and not self.error.message.startswith("SystemExit"):
            return "raised"
        return "killed" if self.code < 0 else "exited"

    def what(self) -> str:
        """``raised ValueError: bad shape``, ``exited with code 3``, ``was killed by SIGKILL``."""
        if self.stopped:
            return "was stopped"
        if self.code == 0:
            return "finished"
        if self.preempted:
            return "was preempted"
        if self.kind == "raised":
            assert self.error is not None
            return f"raised {self.error.first_line}"
        if self.code < 0:
            return f"was killed by {signal_name(-self.code)}"
        return f"exited with code {self.code}"

    def where(self) -> str:
        """`` at step 6 (phase backward)``, or nothing when it never beat."""
        if self.step is None or self.step < 0:
            return ""
        return f" at step {self.step}" + (f" (phase {self.phase})" if self.phase else "")

    def fault(self, attempt: int) -> Fault:
        message = self.error.first_line if self.error is not None else describe_exit(self.code)
        text = f"rank {self.rank} {self.what()}{self.where()}"
        return Fault(self.kind, self.rank, message, self.step, text, attempt)


def failures(ends: list[RankEnd]) -> list[RankEnd]:
    """The failed ranks, first failure first: failures of their own by time, then the ranks
    that only lost a peer, by time."""
    return sorted(
        (e for e in ends if e.failed), key=lambda e: (e.consequence, e.failed_at_ns, e.rank)
    )


def bad_input(ends: list[RankEnd], name: str) -> list[str]:
    """When the first failure is bad input (a rank exited 2 on a gpukit ``ConfigError`` and
    the like), its error as a command line shows it, once however many ranks raised it:
    ``NAME: error: MESSAGE``, one line per different message. Empty otherwise: the failure
    is reported as a crash.

    >>> ends = [RankEnd(r, 2, 1_000, ErrorRecord("ConfigError: x", None, "x")) for r in (0, 1)]
    >>> bad_input(ends, "gpukit train")
    ['gpukit train: error: x']
    """
    failed = failures(ends)
    if not failed or not _is_bad_input(failed[0]):
        return []
    lines: list[str] = []
    for end in failed:
        if _is_bad_input(end):
            assert end.error is not None and end.error.bad_input is not None
            kind = end.error.message.split(":", 1)[0]
            where = f" ({kind} at {end.error.where})" if end.error.where else ""
            line = f"{name}: error: {end.error.bad_input}{where}"
            if line not in lines:
                lines.append(line)
    return lines


def _is_bad_input(end: RankEnd) -> bool:
    return end.code == 2 and end.error is not None and end.error.bad_input is not None


def headline(ends: list[RankEnd], name: str) -> str:
    """``NAME: rank 1 raised ValueError: ... at step 11 — the first failure; rank 0 stopped``."""
    failed = failures(ends)
    if not failed:
        return f"{name}: no rank failed"
    first = failed[0]
    others = [e for e in sorted(ends, key=lambda e: e.rank) if e is not first]
    states = ", ".join(f"rank {e.rank} {_state(e)}" for e in others)
    head = f"{name}: rank {first.rank} {first.what()}{first.where()} — the first failure"
    return f"{head}; {states}" if states else head


def _state(end: RankEnd) -> str:
    if end.failed:
        return "failed after it"
    return end.what().removeprefix("was ")


def rank_lines(ends: list[RankEnd]) -> list[str]:
    """One line per rank, the first failure first, then the other failures, then the rest:
    ``  rank 0 at step 6 (phase forward): raised RuntimeError: ...``."""
    failed = failures(ends)
    rest = sorted((e for e in ends if not e.failed), key=lambda e: e.rank)
    lines = []
    for end in failed + rest:
        what = end.what().removeprefix("was ")
        if end.stopped:
            what = "stopped by the launcher"
        elif end.kind == "raised" and end.code not in (0, 1):
            what += f" (exit code {describe_exit(end.code)})"
        if end.failed and end.consequence and end is not failed[0]:
            what += " (a consequence: a peer had gone)"
        lines.append(f"  rank {end.rank}{end.where()}: {what}")
    return lines


def is_consequence(message: str) -> bool:
    """The error only says that a peer went away (the peer's failure is the news).

    >>> is_consequence("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    True
    """
    return bool(_CONSEQUENCE.search(message))


def first_line(text: str, width: int = 160) -> str:
    """The first non-empty line of ``text``, cut to ``width`` characters."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(code: int) -> str:
    """``1`` stays ``1``; a negative code is a signal and gets its name: ``-6 (SIGABRT)``.

    A script that raises without destroying its gloo process group can abort in C++ while the
    interpreter shuts down, so the rank that raised may end with SIGABRT rather than 1.

    >>> describe_exit(-9)
    '-9 (SIGKILL)'
    """
    if code >= 0:
        return str(code)
    return f"{code} ({signal_name(-code)})"
