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
# Exit codes of a process that stopped on request: gpukit's Preempted, a second Ctrl-C (130),
# or killed by SIGTERM or SIGINT with no handler of its own.
_STOP_CODES = (PREEMPTED_EXIT, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)
# What gpukit's command line exits with on a GpukitError: bad input, a checkpoint the disk
# refused. Running it again fails the same way.
BAD_INPUT_EXIT = 2


@dataclass(frozen=True)
class ErrorRecord:
    """The error a rank's runner recorded: ``"ValueError: bad shape"`` and when; for bad
    input (a gpukit ``ConfigError`` and the like, exit code 2), the message alone and where
    the script raised it (``"train.py:12"``; None for gpukit's own commands)."""

    message: str
    time_ns: int | None = None
    bad_input: str | None = None
    where: str | None = None
    will_repeat: bool = False  # a gpukit error that a restart would meet again

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
            will_repeat=extra.get("will_repeat") is True,
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
    will_repeat: bool = False  # bad input or a save the disk refused: the same again
    saved: int = -1  # the job's newest checkpoint once this attempt ended (-1: none)

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
    where_called: str = ""  # its last Runtime call and its line: "rt.step at train.py:9"
    calls: int = 0  # how many calls where ranks meet it had made by then (heartbeat.Beat)

    @property
    def preempted(self) -> bool:
        """It stopped because it was asked to (and saved), not because it broke. A rank
        ended by SIGTERM or SIGINT counts too, whoever sent it (a script without a handler, or
        a scheduler that signalled that one process): a request to stop is never a crash to
        restart."""
        recorded = self.error is not None and self.error.message.startswith("Preempted")
        return self.code in _STOP_CODES or recorded

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

    def fault(self, attempt: int, ends: list[RankEnd] | None = None) -> Fault:
        split = diverged(ends) if ends else None
        if split is not None and split[0] is self:
            rank, text = self.rank, split[1]
            return Fault("diverged", rank, text, self.step, f"rank {rank} {text}", attempt)
        message = self.error.first_line if self.error is not None else describe_exit(self.code)
        text = f"rank {self.rank} {self.what()}{self.where()}"
        repeats = self.code == BAD_INPUT_EXIT or (self.error is not None and self.error.will_repeat)
        return Fault(self.kind, self.rank, message, self.step, text, attempt, repeats)

    @property
    def collective_broke(self) -> bool:
        """It failed only in that a collective broke under it: its backend aborted it
        (SIGABRT, gloo's "collective mismatch") or it raised a collective's error."""
        if self.error is None:
            return self.code == -signal.SIGABRT
        text = self.error.message
        return self.consequence or bool(
            text.startswith("DistributedError") or re.search(r"gloo|nccl", text, re.I)
        )


def diverged(ends: list[RankEnd]) -> tuple[RankEnd, str] | None:
    """The rank that left the others' sequence of Runtime calls, and what it did, when ranks
    disagree on a collective (a call skipped or added on some ranks only): the backend aborts
    on one of them, so the first failure is a victim.

    It is told from each rank's last heartbeat: every rank had made the same number of calls
    where ranks meet (backward, optimizer step, collective, save) but stands in a different
    one. The rank outside the majority diverged; between two
    groups of one size nothing tells which side skipped a call or made one more, and both are
    named as such. Nothing is said when a rank failed of its own accord, or when the ranks
    stand at different counts (one waits for another that stopped, which is no disagreement).

    >>> ar, bw = "rt.all_reduce at train.py:14", "rt.backward at train.py:10"
    >>> ends = [RankEnd(0, -6, 1, step=4, where_called=ar, calls=17),
    ...         RankEnd(1, -9, 2, stopped=True, step=4, where_called=bw, calls=17)]
    >>> print(diverged(ends)[1])  # doctest: +NORMALIZE_WHITESPACE
    disagrees with rank 0 at step 4, at the 17th call where ranks meet: it is in
    rt.backward at train.py:10, rank 0 in rt.all_reduce at train.py:14 (one of them skipped
    a call the other made, or made one more)
    """
    failed = [e for e in ends if e.failed]
    if not failed or not all(e.collective_broke for e in failed):
        return None  # a rank failed of its own accord: that is the news
    known = [e for e in ends if e.where_called and e.calls > 0]
    if len(known) < 2 or len({e.calls for e in known}) != 1:
        return None
    groups: dict[str, list[RankEnd]] = {}
    for end in known:
        groups.setdefault(end.where_called, []).append(end)
    if len(groups) < 2:
        return None
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    step = f" at step {known[0].step}" if known[0].step is not None and known[0].step >= 0 else ""
    if sizes[0] > sizes[1]:
        majority = max(groups.values(), key=len)
        odd = min((e for e in known if e not in majority), key=lambda e: e.rank)
        others = ", ".join(str(e.rank) for e in majority)
        ranks, wait = ("rank", "waits") if len(majority) == 1 else ("ranks", "wait")
        text = (
            f"diverged{step}: it went on to {odd.where_called} while {ranks} {others} {wait} "
            f"in {majority[0].where_called}"
        )
        return odd, text
    first = min(known, key=lambda e: e.rank)
    odd = min((e for e in known if e.where_called != first.where_called), key=lambda e: e.rank)
    text = (
        f"disagrees with rank {first.rank}{step}, at the {_ordinal(odd.calls)} call where "
        f"ranks meet: it is in {odd.where_called}, rank {first.rank} in "
        f"{first.where_called} (one of them skipped a call the other made, or made one more)"
    )
    return odd, text


def _ordinal(n: int) -> str:
    """``17th``, ``21st``, ``112th``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def failures(ends: list[RankEnd]) -> list[RankEnd]:
    """The failed ranks, first failure first: the rank that diverged from the others'
    collectives (see :func:`diverged`), then failures of their own by time, then the ranks
    that only lost a peer, by time."""
    split = diverged(ends)
    failed = sorted(
        (e for e in ends if e.failed), key=lambda e: (e.consequence, e.failed_at_ns, e.rank)
    )
    return failed if split is None else [split[0], *(e for e in failed if e is not split[0])]


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
    split = diverged(ends)
    if split is not None:
        states = ", ".join(f"rank {e.rank} {e.what().removeprefix('was ')}" for e in others)
        return (
            f"{name}: rank {first.rank} {split[1]} — the first failure, whatever the others "
            f"report ({states}): every rank must make the same collective calls in the same "
            "order; a call made on some ranks only (under an `if rank ...`, or a `continue` "
            "before it) breaks the step"
        )
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
    rest = sorted((e for e in ends if e not in failed), key=lambda e: e.rank)
    lines = []
    for end in failed + rest:
        what = end.what().removeprefix("was ")
        if end.stopped:
            what = "stopped by the launcher"
        elif end.kind == "raised" and end.code not in (0, 1):
            what += f" (exit code {describe_exit(end.code)})"
        if end.failed and end.consequence and end is not failed[0]:
            what += " (a consequence: a peer had gone)"
        call = f", in {end.where_called}" if end.where_called else ""
        lines.append(f"  rank {end.rank}{end.where()}{call}: {what}")
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
