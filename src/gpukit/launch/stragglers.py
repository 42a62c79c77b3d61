"""Naming the rank the others wait for: a straggler.

Fed each rank's newest window (its own time per step, ``rank_stats``) about once a second, the
detector judges every rank against the others: slow when its own time per step is over
``factor`` times the median of the other ranks'. A rank slow for ``steps`` of its steps in a
row is named once; once it has been no longer slow for ``steps`` steps, it has recovered, said
once too. Steps, not reads, are counted: a rank seen twice at the same step (a node's post read
again) counts nothing twice. A window is an average over its steps, so one window alone never
names a rank (nor says it recovered), however many steps it spans: a pause of a second (a
collection, a write) in a window of fast steps makes the whole window slow, not the rank.

What it says names where the time goes: the phase among data, forward, optimizer and the user's
code between steps (loop) in which the rank spends the most over the others' median, and what
NVML saw of its GPU (``gpu_watch``: throttled clocks, other processes) when it saw something.

>>> d = Stragglers(factor=1.2, steps=20)
>>> def seen(step, slow):
...     own = {"data": 0.03 if slow else 0.001, "forward": 0.02, "optimizer": 0.0, "loop": 0.0}
...     return [Seen(0, 0, "h", step, 0.021, dict(own, data=0.001)), Seen(1, 0, "h", step,
...             sum(own.values()), own)]
>>> [e["kind"] for s in range(0, 50, 10) for e in d.judge(seen(s, True), attempt=0, now=0.0)]
['straggler']
>>> [e["kind"] for s in range(50, 90, 10) for e in d.judge(seen(s, False), attempt=0, now=0.0)]
['straggler-recovered']
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from gpukit.launch.rank_stats import OWN_PHASES

DEFAULT_FACTOR = 1.2
DEFAULT_STEPS = 20
MIN_WINDOWS = 2  # a run of slow (or good) steps spans at least this many windows
# The GPU's state words worth saying beside a straggler: others are not its slowness.
_GPU_WORDS = ("power cap", "thermal", "hardware thermal", "hardware slowdown", "power brake")


@dataclass(frozen=True)
class Seen:
    """One rank's newest window, as the detector reads it (a RANK of ``live.json``)."""

    rank: int
    node: int
    host: str
    step: int
    own_s: float
    phases_s: dict[str, float]  # per step, in each of rank_stats.OWN_PHASES
    gpu: dict[str, Any] | None = None  # gpu_watch's reading of the rank's GPU

    @classmethod
    def of(cls, rank: dict[str, Any]) -> Seen | None:
        """From a RANK record; None when it has no window yet."""
        if rank.get("own_s") is None or not rank.get("phases_s"):
            return None
        return cls(
            int(rank["rank"]),
            int(rank.get("node", 0)),
            str(rank.get("host", "")),
            int(rank.get("step", 0)),
            float(rank["own_s"]),
            {p: float(rank["phases_s"].get(p, 0.0)) for p in OWN_PHASES},
            rank.get("gpu"),
        )


@dataclass
class _Run:
    """A rank's current run of slow (or, once named, of good) steps."""

    since: int | None = None  # the step the run began at
    windows: int = 0  # the windows seen in the run (a step moved between two)
    named: dict[str, Any] | None = None  # the event that named it, while it is a straggler
    last_step: int | None = None


@dataclass
class Stragglers:
    """The detector (see the module docstring); ``steps=0`` turns it off."""

    factor: float = DEFAULT_FACTOR
    steps: int = DEFAULT_STEPS
    _runs: dict[int, _Run] = field(default_factory=dict)

    @property
    def now_slow(self) -> list[dict[str, Any]]:
        """The events of the ranks named and not recovered."""
        return [r.named for _, r in sorted(self._runs.items()) if r.named is not None]

    def reset(self) -> None:
        """A new attempt: steps start again."""
        self._runs.clear()

    def judge(self, seen: list[Seen], attempt: int, now: float) -> list[dict[str, Any]]:
        """The events (EVENT records) of this read: ranks named, ranks recovered."""
        if self.steps <= 0 or len(seen) < 2:
            return []
        events = []
        for rank in seen:
            others = [s for s in seen if s.rank != rank.rank]
            median = statistics.median(s.own_s for s in others)
            slow = median > 0 and rank.own_s > self.factor * median
            run = self._runs.setdefault(rank.rank, _Run())
            before, run.last_step = run.last_step, rank.step
            if before is not None and rank.step < before:
                run.since, run.named = None, None  # it went back: a new attempt's steps
            # While unnamed the run counts slow steps; once named, steps no longer slow.
            counting = slow if run.named is None else not slow
            if not counting:
                run.since = None
                continue
            if run.since is None:
                run.since = before if before is not None and before < rank.step else rank.step
                run.windows = 0
            if before is None or before < rank.step:
                run.windows += 1
            if rank.step - run.since < self.steps or run.windows < MIN_WINDOWS:
                continue
            run.since = None
            if run.named is None:
                run.named = _named(rank, others, median, attempt, now)
                run.named["text"] = _line(rank, others, median, self.steps)
                events.append(run.named)
            else:
                events.append(_recovered(rank, run.named, self.steps, attempt, now))
                run.named = None
        return events


def _slowdown(rank: Seen, median: float) -> float:
    return round(rank.own_s / median, 2)


def _phase(rank: Seen, others: list[Seen]) -> tuple[str, float]:
    """The phase with the largest excess over the others' median, and that excess."""
    excess = {
        p: rank.phases_s[p] - statistics.median(o.phases_s[p] for o in others) for p in OWN_PHASES
    }
    phase = max(OWN_PHASES, key=lambda p: excess[p])
    return phase, excess[phase]


def gpu_words(gpu: dict[str, Any] | None) -> str:
    """What NVML saw of a straggler's GPU worth saying, "" when nothing.

    >>> gpu_words({"index": 1, "throttle": ["power cap"], "other_processes": 0})
    'GPU 1: clocks throttled (power cap)'
    """
    if not gpu:
        return ""
    said = []
    throttled = [w for w in gpu.get("throttle") or [] if w in _GPU_WORDS]
    if throttled:
        said.append(f"clocks throttled ({', '.join(throttled)})")
    others = gpu.get("other_processes") or 0
    if others:
        said.append(f"{others} other process(es) on it")
    return f"GPU {gpu.get('index')}: {'; '.join(said)}" if said else ""


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _line(rank: Seen, others: list[Seen], median: float, steps: int) -> str:
    phase, excess = _phase(rank, others)
    line = (
        f"straggler: rank {rank.rank} (node {rank.node}, host {rank.host}) is "
        f"{_slowdown(rank, median):g}x slower than the median rank for {steps} steps (own time "
        f"{_ms(rank.own_s)} vs {_ms(median)} per step), mostly in {phase} "
        f"(+{_ms(max(excess, 0.0))} per step)"
    )
    gpu = gpu_words(rank.gpu)
    return f"{line}; {gpu}" if gpu else line


def _named(
    rank: Seen, others: list[Seen], median: float, attempt: int, now: float
) -> dict[str, Any]:
    return {
        "time": now,
        "kind": "straggler",
        "attempt": attempt,
        "step": rank.step,
        "rank": rank.rank,
        "node": rank.node,
        "host": rank.host,
        "slowdown": _slowdown(rank, median),
        "phase": _phase(rank, others)[0],
        "text": "",
    }


def _recovered(
    rank: Seen, named: dict[str, Any], steps: int, attempt: int, now: float
) -> dict[str, Any]:
    return {
        **named,
        "time": now,
        "kind": "straggler-recovered",
        "attempt": attempt,
        "step": rank.step,
        "text": (
            f"straggler recovered: rank {rank.rank} (node {rank.node}, host {rank.host}) has "
            f"kept up with the others for {steps} steps"
        ),
    }
