"""``restarts --soak N``: a run under ``--max-restarts 60`` that N faults hit at random moments,
and whether it still ends with the weights of a run that none hit, bit for bit.

The job: ``gpukit train --workload mlp --strategy ddp`` on 2 ranks (gloo on this machine's
CPU), saving every 2 steps, under ``run_job``; each rank runs through
:mod:`gpukit.bench.soak_rank`, which writes its process id on its first line. A thread sends
each fault from outside, to a random rank, at a random moment of the attempt it waits for:

- ``import`` (the interpreter starting, torch and gpukit importing), ``start`` (joining the
  process group), ``setup``, ``load`` (reading the checkpoint): the start-up of a restart;
- ``step`` (1 to 3 steps into the attempt) and ``save`` (a rank in ``rt.save``).

A fault is ``SIGKILL`` (nothing runs on the way out: the kernel's out-of-memory killer) or,
for the given number of them, ``SIGTERM`` at a step (a preemption: the job saves and exits 143,
and the soak runs it again with ``--resume``). The moment a fault really landed in is read
from the rank's heartbeat as it is sent. Start-up moments of a fast start (a warm interpreter)
may find the rank already further; the table shows where each one landed.

The launcher restarts only a job that has trained, and stops one whose failed attempts save
nothing new ``crash_loop`` (3) times in a row: those rules are not what a soak tests, so each
run's first fault waits for its first checkpoint (saved, or loaded with ``--resume``), and
after 2 faults in a row the next one waits for a checkpoint past every step a fault found.

Per fault: the step its rank had reached, the steps redone (that step minus the newest
checkpoint) and the time lost (the fault to the first step done by a later attempt, as the
launcher saw it). The seed is printed: ``--seed S`` runs the same faults again. One fault in
five is a SIGTERM.

>>> [shot.signal for shot in plan(4, seed=1, terms=1)].count("SIGTERM")
1
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from gpukit.bench import soak_rank
from gpukit.bench.environment import environment_of
from gpukit.bench.plotting import figure
from gpukit.bench.result import BenchResult, Column
from gpukit.errors import GpukitError
from gpukit.launch import RUNNER, run_job
from gpukit.launch.heartbeat import Beat, read
from gpukit.launch.restarts import ATTEMPTS_FILE, DEFAULT_CRASH_LOOP

NPROC = 2
STEPS = 40
# The steps a fault may take: up to 3 into its attempt, then a new checkpoint before the next
# one may hit again (a crash loop otherwise); the run is made that long for every fault to land.
STEPS_PER_FAULT = 4
SAVE_EVERY = 2
MAX_RESTARTS = 60
MOMENTS = ("import", "start", "setup", "load", "step", "save")
_LOOP = ("loop", "data", "forward", "backward", "optimizer", "collective")
_POLL_S = 0.0005  # a save of this small model is over in milliseconds
_WAIT_S = 120.0  # a guard: an attempt that never comes (the job ended) drops the fault


@dataclass(frozen=True)
class Shot:
    """One fault to send: ``signal`` to ``rank`` at ``moment`` (``steps`` into the attempt
    for ``step``)."""

    signal: str
    rank: int
    moment: str
    steps: int = 1


@dataclass
class Hit:
    """A fault as it landed: the attempt (of the run ``part``), the rank's phase and step."""

    shot: Shot
    part: int
    attempt: int
    at: float  # time.time() when it was sent
    phase: str  # where the rank was: its heartbeat's phase, or "import" before its first beat
    step: int | None
    redone: int
    lost_s: float | None = None


@dataclass
class Soak:
    """What a soak did and how it ended."""

    seed: int
    hits: list[Hit] = field(default_factory=list)
    codes: list[int] = field(default_factory=list)  # each run's exit code (143s, then 0)
    restarts: int = 0  # restarts the launcher made
    saved_on_stop: list[int] = field(default_factory=list)  # the checkpoint each SIGTERM left
    bitwise_equal: bool = False
    output: str = ""


def plan(count: int, seed: int, terms: int = 0) -> list[Shot]:
    """``count`` faults at random (``seed``), ``terms`` of them ``SIGTERM``s at a step."""
    rng = random.Random(seed)
    where_terms = set(rng.sample(range(count), min(terms, count)))
    shots = []
    for i in range(count):
        if i in where_terms:
            shots.append(Shot("SIGTERM", rng.randrange(NPROC), "step", rng.randint(1, 3)))
        else:
            moment = rng.choice(MOMENTS)
            shots.append(Shot("SIGKILL", rng.randrange(NPROC), moment, rng.randint(1, 3)))
    return shots


def command(out: Path, steps: int = STEPS, resume: bool = False) -> list[str]:
    """One rank's command line: ``gpukit train`` through the runner and ``soak_rank``."""
    script = str(Path(soak_rank.__file__).resolve())
    train = ["train", "--workload", "mlp", "--strategy", "ddp", "--max-steps", str(steps)]
    train += ["--save-every", str(SAVE_EVERY), "--out", str(out)]
    return [sys.executable, str(RUNNER), script, *train, *(["--resume"] if resume else [])]


class _Shooter(threading.Thread):
    """Sends the shots to one run of the job (until a SIGTERM ends it, or the run ends)."""

    def __init__(self, folder: Path, part: int, shots: list[Shot], soak: Soak) -> None:
        super().__init__(daemon=True)
        self.folder, self.part, self.shots, self.soak = folder, part, shots, soak
        self.done = threading.Event()  # the run is over
        self.stalled = 0  # faults in a row that did not wait for a new checkpoint
        self.reached = -1  # the furthest step a fault of this run found a rank at
        self._bases: dict[tuple[int, int], int] = {}

    def run(self) -> None:
        attempt = 0
        while self.shots and not self.done.is_set():
            shot = self.shots[0]
            pid = self._pid(shot.rank, attempt)
            if pid is None:
                return
            waits = attempt == 0 or self.stalled >= DEFAULT_CRASH_LOOP - 1
            if waits:
                # A checkpoint past every step a fault found: new, whatever landed before.
                self._until(partial(self._newer, attempt, self.reached))
            self._wait(shot, attempt)
            if self.done.is_set():
                return
            beat = self._beat(shot.rank, attempt)
            step = max((b.step for b in self._beats(attempt)), default=None)
            saved = self._saved(attempt)
            try:
                os.kill(pid, getattr(signal, shot.signal))
            except ProcessLookupError:
                continue  # it had ended on its own: the same shot waits for the next attempt
            at = time.time()
            self.shots.pop(0)
            phase = beat.phase if beat is not None else "import"
            redone = max(step - max(saved, 0), 0) if step is not None else 0
            self.soak.hits.append(Hit(shot, self.part, attempt, at, phase, step, redone))
            if shot.signal == "SIGTERM":
                return  # the run saves and ends; the next one is another run
            self._until(partial(self._gone, pid))
            self.stalled = 0 if waits else self.stalled + 1
            self.reached = max(self.reached, step if step is not None else -1, saved)
            attempt += 1

    def _pid(self, rank: int, attempt: int) -> int | None:
        path = self.folder / f"pid-{rank}-{attempt}"
        self._until(path.exists)
        return int(path.read_text()) if path.exists() else None

    def _wait(self, shot: Shot, attempt: int) -> None:
        def there() -> bool:
            beat = self._beat(shot.rank, attempt)
            if shot.moment == "import":
                return True
            if beat is None:
                return False
            base = self._base(shot.rank, attempt, beat)
            if shot.moment == "step":
                return beat.phase in _LOOP and beat.step >= base + shot.steps
            if shot.moment == "save":
                # A save is over in milliseconds: past a few steps, take the moment there is.
                return beat.phase == "save" or beat.step >= base + 3 * SAVE_EVERY
            return beat.phase == shot.moment or beat.phase not in ("start", "setup", "load")

        if shot.moment == "import":
            time.sleep(random.Random(attempt).uniform(0.0, 0.02))
        self._until(there)

    def _base(self, rank: int, attempt: int, beat: Beat) -> int:
        """The step the rank's attempt was at when first seen in its training loop."""
        if beat.phase in _LOOP:
            self._bases.setdefault((rank, attempt), beat.step)
        return self._bases.get((rank, attempt), beat.step + 1)

    def _beat(self, rank: int, attempt: int) -> Beat | None:
        beat = read(self.folder, rank)
        return beat if beat is not None and beat.attempt == attempt else None

    def _beats(self, attempt: int) -> list[Beat]:
        return [b for r in range(NPROC) if (b := self._beat(r, attempt)) is not None]

    def _saved(self, attempt: int) -> int:
        """The newest checkpoint every rank of the attempt took part in (-1: none seen)."""
        beats = self._beats(attempt)
        return min(b.saved_step for b in beats) if len(beats) == NPROC else -1

    def _newer(self, attempt: int, than: int) -> bool:
        return self._saved(attempt) > than

    def _gone(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    def _until(self, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + _WAIT_S
        while not self.done.is_set() and time.monotonic() < deadline:
            if ready():
                return
            time.sleep(_POLL_S)


def soak(
    count: int,
    seed: int,
    folder: Path,
    *,
    terms: int = 0,
    steps: int = STEPS,
    shots: list[Shot] | None = None,
) -> Soak:
    """Train once without faults, then again under ``count`` faults (``terms`` SIGTERMs, each
    followed by a run with ``--resume``), in ``folder``; compare the final weights. ``shots``:
    these faults instead of random ones."""
    result = Soak(seed)
    lines = io.StringIO()
    code = run_job(command(folder / "plain", steps), NPROC, out=lines, job_dir=folder / "job-plain")
    if code != 0:
        raise GpukitError(f"the run without faults exited {code}:\n{lines.getvalue()}")
    shots = list(shots) if shots is not None else plan(count, seed, terms)
    part, resume = 0, False
    while True:
        job = folder / f"job-{part}"
        job.mkdir(parents=True)
        shooter = _Shooter(job, part, shots, result)
        shooter.start()
        try:
            code = run_job(
                command(folder / "run", steps, resume),
                NPROC,
                max_restarts=MAX_RESTARTS,
                out=lines,
                job_dir=job,
            )
        finally:
            shooter.done.set()
            shooter.join()
        result.codes.append(code)
        _time_lost(job, [h for h in result.hits if h.part == part])
        if code != 143 or part > count:
            break
        result.saved_on_stop.append(_latest(folder / "run"))
        part, resume = part + 1, True
    result.output = lines.getvalue()
    result.restarts = result.output.count(" restarting\n")
    if code == 0:
        ours, plain = _final(folder / "run", steps), _final(folder / "plain", steps)
        result.bitwise_equal = ours.keys() == plain.keys() and all(
            ours[k].equal(plain[k]) for k in ours
        )
    return result


def _time_lost(job: Path, hits: list[Hit]) -> None:
    """Each SIGKILL's time lost: to the first step done by a later attempt of its run."""
    try:
        attempts = [json.loads(x) for x in (job / ATTEMPTS_FILE).read_text().splitlines()]
    except OSError:
        return
    for hit in hits:
        later = [a["first_step"] for a in attempts if a["attempt"] > hit.attempt]
        firsts = [t for t in later if t is not None]
        if hit.shot.signal == "SIGKILL" and firsts:
            hit.lost_s = max(firsts[0] - hit.at, 0.0)


def _latest(out: Path) -> int:
    name = (out / "checkpoints" / "latest").read_text().strip()
    return int(name.removeprefix("step-"))


def _final(out: Path, steps: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folder = out / "checkpoints" / f"step-{steps:08d}"
    return dict(load_file(str(folder / "model.safetensors")))


TITLE = "A run under --max-restarts 60 that random faults hit, against one that none hit"
COLUMNS = (
    Column("fault"),
    Column("signal", compare=False),
    Column("rank", compare=False),
    Column("aimed", "aimed at", compare=False),
    Column("landed", "landed in", compare=False),
    Column("step", compare=False),
    Column("redone", "steps redone", compare=False),
    Column("lost_s", "time lost", "s", 2),
)


def run(quick: bool = False, count: int = 10, seed: int | None = None) -> BenchResult:
    """``count`` faults (see the module doc); ``seed`` None: a fresh one, printed."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    terms = count // 5
    steps = max(STEPS, STEPS_PER_FAULT * count)
    with tempfile.TemporaryDirectory(prefix="gpukit-soak-") as folder:
        done = soak(count, seed, Path(folder), terms=terms, steps=steps)
    rows = [
        {
            "fault": i + 1,
            "signal": h.shot.signal,
            "rank": h.shot.rank,
            "aimed": h.shot.moment,
            "landed": h.phase,
            "step": h.step,
            "redone": h.redone,
            "lost_s": h.lost_s,
        }
        for i, h in enumerate(done.hits)
    ]
    lost = [h.lost_s for h in done.hits if h.lost_s is not None]
    short = len(done.hits) < count
    unsent = [f"only {len(done.hits)} of the {count} faults were sent before the run ended"]
    return BenchResult(
        experiment="restarts",
        title=TITLE,
        keys=("fault",),
        columns=COLUMNS,
        rows=rows,
        summary={
            "seed": seed,
            "faults_sent": len(done.hits),
            "restarts_survived": done.restarts,
            "resumed_after_sigterm": len(done.saved_on_stop),
            "time_lost_median_s": statistics.median(lost) if lost else None,
            "time_lost_max_s": max(lost) if lost else None,
            "steps_redone": sum(h.redone for h in done.hits),
            "exit_codes": " ".join(str(c) for c in done.codes),
            "bitwise_equal": done.bitwise_equal,
        },
        notes=[
            f"{NPROC} ranks of `gpukit train --workload mlp --strategy ddp --max-steps {steps} "
            f"--save-every {SAVE_EVERY}` under gpukit's launcher, --max-restarts {MAX_RESTARTS};"
            f" {count} faults ({terms} SIGTERM), seed {seed} (--seed {seed} repeats them)",
            "time lost: from the fault to the first step done by a later attempt (the "
            "launcher's view, beats read every 0.15 s); bitwise_equal: the final weights "
            "against a run without faults",
            *(unsent if short else []),
        ],
        parameters={"quick": quick, "count": count, "seed": seed, "terms": terms},
        environment=environment_of([torch.device("cpu")]),
        raw={"output": done.output},
    )


def plot(result: BenchResult, path: Path) -> None:
    """The time each fault cost, in the order they came."""
    rows = result.rows
    with figure(path, TITLE, "fault", "seconds lost", size=(9.0, 4.0)) as ax:
        xs = [r["fault"] for r in rows]
        ax.bar(xs, [r["lost_s"] or 0.0 for r in rows])
        ax.set_xticks(xs, [f"{r['fault']}\n{r['landed']}" for r in rows], fontsize=7)
