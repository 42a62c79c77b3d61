"""The job loop: ``run_job`` runs a command's ranks attempt after attempt, each attempt under
the supervisor, until one succeeds, a stop is requested, or the restart rules say stop; it
prints what happened and returns the exit code for a command line.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from gpukit import _env
from gpukit._util.files import make_folder
from gpukit.errors import ConfigError
from gpukit.launch.attempt_watch import Outcome
from gpukit.launch.failures import (
    BAD_INPUT_EXIT,
    PREEMPTED_EXIT,
    Fault,
    bad_input,
    headline,
    rank_lines,
)
from gpukit.launch.hang_reports import REPORT_FILE
from gpukit.launch.job_folders import fresh_job_dir, release, swept
from gpukit.launch.job_records import JobRecord
from gpukit.launch.node_messages import settle
from gpukit.launch.rendezvous import JobState, LocalMeeting, Nodes, StoreMeeting
from gpukit.launch.restarts import (
    DEFAULT_CRASH_LOOP,
    Restart,
    record_attempt,
    redone,
    stop_reason,
    summary,
    trained,
)
from gpukit.launch.signals import Signals
from gpukit.launch.starters import CommandStarter, RankStarter
from gpukit.launch.stragglers import DEFAULT_FACTOR, DEFAULT_STEPS
from gpukit.launch.supervisor import Attempt, Settings
from gpukit.launch.warm_restarts import WarmRestarts
from gpukit.launch.workers import kill_leftovers

# Run a script (``RUNNER script.py args``) or a module (``RUNNER -m package args``) through it:
# it records the error with its time and dumps the stacks when a hang is being reported.
RUNNER = Path(__file__).resolve().parent / "_launched_script.py"
DEFAULT_HANG_TIMEOUT = 300.0
GRACE_S = 1.5  # after the first failure, for the others to fail on their own
INTERRUPTED_EXIT = 130  # a second Ctrl-C stopped the job at once, as a shell reports SIGINT


def run_job(
    command: list[str] | RankStarter,
    nproc: int,
    *,
    max_restarts: int = 0,
    hang_timeout: float | None = DEFAULT_HANG_TIMEOUT,
    env: Mapping[str, str] | None = None,
    out: TextIO | None = None,
    name: str = "gpukit launch",
    master_port: int | None = None,
    crash_loop: int = DEFAULT_CRASH_LOOP,
    grace: float = GRACE_S,
    stop_timeout: float | None = None,
    job_dir: str | Path | None = None,
    startup_timeout: float | None = None,
    on_attempt: Callable[[Attempt, Outcome], None] | None = None,
    nodes: Nodes | None = None,
    record_dir: str | Path | None = None,
    total_steps: int | None = None,
    straggler_factor: float = DEFAULT_FACTOR,
    straggler_steps: int = DEFAULT_STEPS,
) -> int:
    """Run ``command`` as ``nproc`` ranks on this machine; the exit code for a command line:
    0 success, 143 stopped on request (preempted: the ranks saved), 130 stopped at once by a
    second Ctrl-C, 2 bad input (a rank refused what it was given: its error is printed once, as
    one process prints it, and the job is not restarted), 1 failed or hung.

    ``env``: variables for the ranks on top of this process's environment (``OMP_NUM_THREADS``
    is 1 per rank with several ranks unless set, as under torchrun). ``hang_timeout``: seconds
    without a heartbeat before a rank counts as hung (0: never; None: the default, 300); only
    ranks that beat, i.e. that run a gpukit Runtime, are watched, each from its first beat and
    once every rank has beaten. ``startup_timeout``: seconds a rank may take from its start to
    its first beat, once another rank has beaten (0: never; None: ``GPUKIT_STARTUP_TIMEOUT``,
    else 900); the job is then stopped, and restarted only if it has trained (see
    ``restarts``). ``master_port``: the first
    attempt's port (later attempts take a fresh one; default: a free one each time).
    ``crash_loop``: stop restarting after this many failed attempts in a row that saved no new
    checkpoint. ``grace``:
    seconds the other ranks get to fail on their own after the first failure.
    ``stop_timeout``: seconds the ranks get to save and exit after a stop request (default:
    ``GPUKIT_STOP_GRACE``, else 25, under the 30 s Slurm and Kubernetes give before SIGKILL).
    ``job_dir``: the job's folder (kept; default a temporary one, removed at the end unless a
    hang was caught). Progress and failures are printed to ``out`` (default stderr), each line
    starting with ``name``. ``command`` may also be a ``RankStarter`` that starts each rank
    its own way (``rt.launch`` forks for a function a fresh interpreter could not import); a
    list is run by ``CommandStarter``. ``on_attempt(attempt, outcome)`` is told how each attempt
    ended (``rt.launch`` raises its rank's error from it). ``nodes``: this machine is one node
    of a job over several (every node calls ``run_job`` with the same command and ``nproc``);
    its ranks are ``node * nproc + 0..nproc-1`` of ``nnodes * nproc``.

    While it runs, the launcher keeps ``JOB/live.json`` (every rank's figures, for ``gpukit
    top``) and ``JOB/events.jsonl`` in the job's folder (``job_records``), and names
    stragglers: a rank whose own time per step is over ``straggler_factor`` times the others'
    median for ``straggler_steps`` steps in a row (0: never). ``record_dir``: a folder that
    also gets the job's events, samples of its ranks' figures and the job folder's path
    (``gpukit train --out``); ``total_steps``: the steps the run will take, for an estimate of
    the time left.

    Call it from the thread that will live as long as the job (the main thread, normally): the
    ranks are tied to it, and only there can the launcher catch SIGTERM and SIGINT.

    >>> import sys
    >>> run_job([sys.executable, "-c", "import os; assert os.environ['WORLD_SIZE'] == '2'"], 2)
    0

    Through the runner, a failure is timed to the nanosecond and a hang shows its stacks:
    ``run_job([sys.executable, str(RUNNER), "-m", "gpukit", "train", ...], 2)``.
    """
    if not isinstance(command, RankStarter):
        _check_command(command)
    _check(nproc, max_restarts, hang_timeout, crash_loop)
    if startup_timeout is not None and not 0 <= startup_timeout < float("inf"):
        raise ConfigError(f"startup_timeout={startup_timeout}: give seconds >= 0 (0: never)")
    startup = _env.startup_timeout() if startup_timeout is None else startup_timeout
    straggler_factor, straggler_steps = straggler_settings(straggler_factor, straggler_steps)
    whole = isinstance(total_steps, int) and not isinstance(total_steps, bool)
    if total_steps is not None and not (whole and total_steps >= 0):
        raise ConfigError(f"total_steps={total_steps!r}: give the run's steps (0 or more) or None")
    if job_dir is None:
        for line in swept(name):
            print(line, file=out if out is not None else sys.stderr, flush=True)
    folder = Path(job_dir) if job_dir is not None else fresh_job_dir()
    make_folder(folder, option="job_dir=")
    variables = {**_env.environment(), **(env or {})}
    if nproc > 1:
        variables.setdefault("OMP_NUM_THREADS", "1")  # N ranks sharing the cores, as torchrun
    cold_restarts: str | None = None
    if type(command) is CommandStarter or isinstance(command, list):
        # A job that may restart forks its restarts from a warm server it starts now (a fork
        # of this process, ``rt.launch``'s other way, has what a warm server has already).
        argv = command.command if isinstance(command, CommandStarter) else command
        ranks, cold_restarts = WarmRestarts.for_job(argv, variables, folder, max_restarts)
    else:
        ranks = command
    if record_dir is not None:
        make_folder(record_dir)
    # Made before any rank starts: rank 0 maps the events' counter when it begins.
    record = JobRecord(
        folder,
        name,
        _command_of(command),
        Path(record_dir).resolve() if record_dir is not None else None,
        total_steps,
        straggler_factor,
        straggler_steps,
    )
    settings = Settings(
        ranks=ranks,
        nproc=nproc,
        env=variables,
        folder=folder,
        max_restarts=max_restarts,
        hang_timeout=DEFAULT_HANG_TIMEOUT if hang_timeout is None else hang_timeout or None,
        grace=grace,
        stop_timeout=_env.stop_grace() if stop_timeout is None else stop_timeout,
        name=name,
        out=out if out is not None else sys.stderr,
        startup_timeout=startup or None,
        on_attempt=on_attempt,
        record=record,
    )
    if cold_restarts is not None:
        _say(settings, [f"{name}: {cold_restarts}"])
    try:
        signals = Signals()
        meeting = LocalMeeting(master_port) if nodes is None else StoreMeeting(nodes, nproc)
    except BaseException:
        if isinstance(ranks, WarmRestarts):
            ranks.close()
        raise
    try:
        code = _attempts(settings, signals, meeting, crash_loop)
        with _contained(settings, record):
            record.end(code, _how(code, record), record.attempt)
        return code
    finally:
        signals.restore()
        meeting.close()
        kill_leftovers()
        if isinstance(ranks, WarmRestarts):
            ranks.close()
        # After a hang the stack dumps and the report stay (the report said where).
        if job_dir is None:
            release(folder)
            if not (folder / REPORT_FILE).exists():
                shutil.rmtree(folder, ignore_errors=True)


def _attempts(
    s: Settings, signals: Signals, meeting: LocalMeeting | StoreMeeting, repeats: int
) -> int:
    job = JobState()  # on several nodes, node 0's copy, adopted at every meeting
    restarts: list[Restart] = []
    world: int | None = None
    while True:
        if signals.received:  # asked to stop while deciding to restart: do not
            _say(s, [f"{s.name}: stopped on request before restart {job.attempt}"])
            _say(s, _ended(s, job.faults, restarts, "stopped"))
            return PREEMPTED_EXIT
        place = meeting.next(job)
        if world is not None and place.nnodes * s.nproc != world:
            _say(s, [_world_changed(s.name, world, place.nnodes * s.nproc)])
        world = place.nnodes * s.nproc
        number = job.attempt
        attempt = Attempt(s, number, place.port, signals, max(job.checkpoint, 0))
        attempt.peers, attempt.master_addr = place.peers, place.master_addr
        if s.record is not None:
            with _contained(s, s.record):
                s.record.attempt_begins(place.peers.node, number)
        if isinstance(meeting, StoreMeeting) and meeting.nodes.elastic:
            attempt.waiting = meeting.waiting
        outcome = attempt.run()
        if isinstance(s.ranks, WarmRestarts) and (note := s.ranks.told()):
            _say(s, [f"{s.name}: {note}"])
        outcome = settle(
            outcome, place.peers, s.folder, bool(signals.received), s.stop_timeout, number
        )
        job.attempt += 1
        record_attempt(
            s.folder,
            number,
            outcome.progress,
            outcome.ends,
            outcome.detected_at,
            outcome.stopped_at,
        )
        if restarts:
            restarts[-1].startup_s = outcome.progress.startup_s()
            restarts[-1].resume_s = outcome.progress.resume_s()
        job.checkpoint = max(job.checkpoint, outcome.progress.checkpoint)
        if s.record is not None:
            s.record.checkpoint = job.checkpoint
        if outcome.progress.advanced and outcome.progress.step is not None:
            job.furthest = max(job.furthest, outcome.progress.step)
        faults = job.faults
        if outcome.status == "ok":
            _say(s, summary(s.name, faults, restarts, "done") if restarts else [])
            return 0
        if outcome.status == "rescale":
            _say(
                s,
                [
                    f"{s.name}: nodes are waiting to join: the ranks saved, the job goes on "
                    "with them"
                ],
            )
            continue
        if outcome.status == "preempted" and signals.forced:
            newest = _newest(job.checkpoint)
            line = f"{s.name}: stopped at once by a second Ctrl-C, without saving ({newest})"
            _say(s, [line, *_ended(s, faults, restarts, "stopped")])
            return INTERRUPTED_EXIT
        if outcome.status == "preempted":
            said = stopped_line(s.name, outcome, job.checkpoint)
            _say(s, [said, *_ended(s, faults, restarts, "stopped")])
            return PREEMPTED_EXIT
        if outcome.status == "failed" and outcome.lost:
            _say(s, [f"{s.name}: {outcome.lost}"])
            if s.record is not None:
                with _contained(s, s.record):
                    s.record.event({"kind": "node-lost", "text": outcome.lost}, number)
        elif outcome.status == "failed":
            mistake = bad_input(outcome.ends, s.name)
            if mistake:  # as the command says it in one process; a restart would repeat it
                _say(s, mistake + _ended(s, faults, restarts, "failed"))
                return BAD_INPUT_EXIT
            _say(s, [headline(outcome.ends, s.name), *rank_lines(outcome.ends)])
        assert outcome.fault is not None
        faults.append(replace(outcome.fault, saved=job.checkpoint))
        # The job's history decides, not this attempt's: a job that trained before restarts a
        # failure in a restart's start-up (rendezvous, loading the checkpoint) like any other.
        rule = trained(job.checkpoint, job.furthest)
        why = stop_reason(faults, rule is not None, job.used, s.max_restarts, repeats)
        if why is not None:
            lines = [f"{s.name}: not restarted: {why}"] if why else []
            _say(s, lines + _ended(s, faults, restarts, "failed"))
            return 1
        job.used += 1
        # A rank that failed before its first beat did no step: the attempt began at the
        # checkpoint, and nothing since it is redone.
        step = outcome.progress.step
        lost = redone(
            job.checkpoint if step is None and job.checkpoint >= 0 else step, job.checkpoint
        )
        early = not outcome.progress.advanced
        restarts.append(
            Restart(job.used, outcome.fault, lost, outcome.stop_s, rule=rule or "", early=early)
        )
        _say(s, [f"{s.name}: {restarts[-1].line(s.max_restarts)}"])
        if s.record is not None:
            s.record.restarts = job.used
            cause = outcome.fault
            restart = {"kind": "restart", "rank": cause.rank, "step": cause.step}
            line = restarts[-1].line(s.max_restarts)
            with _contained(s, s.record):
                s.record.event({**restart, "cause": cause.text, "text": line}, number)


def _contained(s: Settings, record: JobRecord) -> AbstractContextManager[None]:
    """Around the launcher's records: their error is said once, never the job's end."""
    return record.contained(lambda line: _say(s, [f"{s.name}: {line}"]))


def _how(code: int, record: JobRecord) -> str:
    """The end in a word, for the job's last event."""
    if code == 0:
        return "finished"
    if code in (PREEMPTED_EXIT, INTERRUPTED_EXIT):
        return "stopped"
    # A hang of an earlier attempt, restarted, is not how a later one ended.
    hung = any(e["kind"] == "hang" and e["attempt"] == record.attempt for e in record.events)
    return "hung" if hung and code == 1 else "failed"


def _command_of(command: list[str] | RankStarter) -> list[str]:
    """The command line the ranks run, as shown (a function's ranks have none)."""
    if isinstance(command, list):
        return [str(a) for a in command]
    argv = getattr(command, "command", None)
    return [str(a) for a in argv] if isinstance(argv, list) else [type(command).__name__]


def straggler_settings(factor: object, steps: object, flags: bool = False) -> tuple[float, int]:
    """The straggler watch's factor and steps from numbers or their text (a command's flags),
    or a :class:`ConfigError` saying what is allowed (``flags``: in the flags' words).

    >>> straggler_settings("1.5", "10")
    (1.5, 10)
    """
    said_factor = f"--straggler-factor {factor}" if flags else f"straggler_factor={factor!r}"
    said_steps = f"--straggler-steps {steps}" if flags else f"straggler_steps={steps!r}"
    try:
        if isinstance(factor, bool):
            raise ValueError
        number = float(factor)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not 1 < number < math.inf:
        raise ConfigError(
            f"{said_factor}: give a number over 1, how many times the median rank's "
            f"time a straggler's own time per step is (default {DEFAULT_FACTOR:g})"
        )
    try:
        if isinstance(steps, (bool, float)):
            raise ValueError
        count = int(steps)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        count = -1
    if count < 0:
        raise ConfigError(
            f"{said_steps}: give a whole number of steps, 0 or more, a rank must stay "
            f"slow before it is named (default {DEFAULT_STEPS}; 0: never name one)"
        )
    return number, count


def watch_settings(record_dir: str | None, factor: object, steps: object) -> dict[str, Any]:
    """``run_job``'s keywords for the job's watch from a command's flags (``--out``,
    ``--straggler-factor``, ``--straggler-steps``), or the :class:`ConfigError` of a bad one.

    >>> watch_settings(None, "1.5", "10")
    {'record_dir': None, 'straggler_factor': 1.5, 'straggler_steps': 10}
    """
    factor, steps = straggler_settings(factor, steps, flags=True)
    return {"record_dir": record_dir, "straggler_factor": factor, "straggler_steps": steps}


def _world_changed(name: str, before: int, now: int) -> str:
    return (
        f"{name}: the world changed from {before} to {now} ranks: data sharding follows the "
        "new world size (a checkpoint resumes, but random streams and data shards do not "
        "continue exactly as they would have)"
    )


def _ended(s: Settings, faults: list[Fault], restarts: list[Restart], how: str) -> list[str]:
    return summary(s.name, faults, restarts, how) if restarts else []


def _newest(saved: int) -> str:
    return f"the newest checkpoint is step {saved}" if saved >= 0 else "no checkpoint"


def stopped_line(name: str, outcome: Outcome, saved: int) -> str:
    """What the launcher says of a job stopped on request. ``saved``: the newest checkpoint of
    the whole job (every attempt's, -1: none), not only this attempt's ranks' (which are -1
    until they load it: ranks killed before that would otherwise name none, or an older one)."""
    head = f"{name}: stopped on request (exit {PREEMPTED_EXIT})"
    if outcome.preempted_message:
        return f"{head}: {outcome.preempted_message}"
    if any(end.stopped for end in outcome.ends):
        newest = _newest(saved)
        return (
            f"{head}; the ranks did not save and exit within the grace period, so they were "
            f"killed ({newest}): give them longer with GPUKIT_STOP_GRACE=SECONDS, within what "
            "the scheduler allows before its SIGKILL"
        )
    if all(end.code == 0 for end in outcome.ends):
        return f"{head}; the ranks had finished their work"
    return (
        f"{head}; every rank has exited, none with a save of its own (a gpukit Runtime with "
        "a checkpoint folder saves on the way out)"
    )


def _say(s: Settings, lines: list[str]) -> None:
    """The lines in one write, each with its newline: ``print`` of text holding newlines
    writes its last line and the final newline apart, and a rank writing to the same
    terminal or pipe in between would land inside that line."""
    if lines:
        s.out.write("".join(f"{line}\n" for line in lines))
        s.out.flush()


def _check_command(command: list[str]) -> None:
    if not command:
        raise ConfigError("run_job: command is empty: give the program and its arguments")


def _check(nproc: int, max_restarts: int, hang_timeout: float | None, repeats: int) -> None:
    if nproc < 1:
        raise ConfigError(f"nproc={nproc}: give at least 1 process")
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts}: give 0 or more")
    if hang_timeout is not None and not hang_timeout >= 0:
        raise ConfigError(f"hang_timeout={hang_timeout}: give seconds >= 0 (0: never)")
    if repeats < 1:
        raise ConfigError(f"crash_loop={repeats}: give 1 or more failed attempts")
