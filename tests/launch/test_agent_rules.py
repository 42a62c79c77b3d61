"""gpukit's launcher, the parts without processes: who failed first, when to restart, whom to
blame for a hang, and what a stack dump says."""

from __future__ import annotations

import errno
import os
import sysconfig
from pathlib import Path

import pytest

from gpukit.errors import OutputWriteError
from gpukit.launch.failures import (
    ErrorRecord,
    Fault,
    RankEnd,
    describe_exit,
    diverged,
    failures,
    headline,
    rank_lines,
    read_error,
)
from gpukit.launch.hang_reports import Frame, Watch, blame, hang_report, main_stack, user_frame
from gpukit.launch.heartbeat import Beat, Heartbeat
from gpukit.launch.restarts import (
    Progress,
    Restart,
    crash_loop,
    no_new_save,
    redone,
    stop_reason,
    trained,
)

PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8093"


def test_a_killed_rank_comes_before_the_peer_that_lost_its_connection_even_if_later() -> None:
    # Rank 0's error was recorded first, but it only says its peer went away.
    ends = [
        RankEnd(0, 1, 5_000, ErrorRecord(PEER, 1_000), step=7, phase="forward"),
        RankEnd(1, -9, 2_000, step=6, phase="backward"),
        RankEnd(2, -9, 9_000, stopped=True, step=6, phase="collective"),
    ]
    assert [e.rank for e in failures(ends)] == [1, 0]
    assert headline(ends, "gpukit launch") == (
        "gpukit launch: rank 1 was killed by SIGKILL at step 6 (phase backward) — the first "
        "failure; rank 0 failed after it, rank 2 stopped"
    )
    assert rank_lines(ends) == [
        "  rank 1 at step 6 (phase backward): killed by SIGKILL",
        "  rank 0 at step 7 (phase forward): raised " + PEER + " (a consequence: a peer had gone)",
        "  rank 2 at step 6 (phase collective): stopped by the launcher",
    ]


def test_among_failures_of_their_own_the_earliest_wins_by_its_recorded_clock() -> None:
    ends = [
        # Raised at 1_000 but its process ended (SIGABRT at shutdown) after rank 1's exit.
        RankEnd(0, -6, 3_000, ErrorRecord("ValueError: bad shape\nmore", 1_000), step=11),
        RankEnd(1, 3, 2_000, ErrorRecord("SystemExit: 3", 1_900)),
    ]
    assert headline(ends, "x").startswith("x: rank 0 raised ValueError: bad shape at step 11 —")
    assert (
        rank_lines(ends)[0]
        == "  rank 0 at step 11: raised ValueError: bad shape (exit code -6 (SIGABRT))"
    )
    assert rank_lines(ends)[1] == "  rank 1: exited with code 3"


def test_ranks_that_finished_or_were_preempted_did_not_fail() -> None:
    ends = [
        RankEnd(0, 0, 1),
        RankEnd(1, 143, 2, ErrorRecord("Preempted: saved at step 4; resume with --resume")),
        RankEnd(2, -15, 3, asked_to_stop=True),
        RankEnd(3, -15, 4),  # a SIGTERM from outside (a scheduler's, to that one process)
        RankEnd(4, -2, 5),  # Ctrl-C to a script without a handler of its own
        RankEnd(5, 130, 6),  # the user's second Ctrl-C: out at once
        RankEnd(6, -9, 7),  # SIGKILL is never a request: the kernel's out-of-memory killer
    ]
    assert [e.rank for e in failures(ends)] == [6]
    assert all(e.preempted for e in ends[1:6]) and not ends[6].preempted
    assert headline(ends[:6], "x") == "x: no rank failed"


def test_a_fault_is_the_same_failure_by_kind_rank_first_line_and_step() -> None:
    a = RankEnd(1, 1, 5, ErrorRecord("ValueError: bad\ntrace 1"), step=3).fault(0)
    b = RankEnd(1, 1, 9, ErrorRecord("ValueError: bad\ntrace 2"), step=3).fault(1)
    c = RankEnd(1, 1, 9, ErrorRecord("ValueError: bad"), step=4).fault(2)
    d = RankEnd(0, 1, 9, ErrorRecord("ValueError: bad"), step=3).fault(3)
    assert a.kind == "raised" and a.message == "ValueError: bad"
    assert a.same_as(b) and not a.same_as(c) and not a.same_as(d)
    assert crash_loop([a, b], repeats=2) and not crash_loop([a, c], repeats=2)
    assert not crash_loop([a, b], repeats=3)
    assert crash_loop([c, a, b, a], repeats=3)


def test_restart_rules_in_order() -> None:
    boom = Fault("killed", 1, "-9 (SIGKILL)", 6, "rank 1 was killed by SIGKILL at step 6")
    assert stop_reason([boom], True, 0, 0, 3) == ""  # no restarts asked for: nothing to say
    assert "failed before its first step" in str(stop_reason([boom], False, 0, 2, 3))
    assert "crash loop" in str(stop_reason([boom] * 3, True, 2, 5, 3))
    assert "no restarts left" in str(stop_reason([boom], True, 2, 2, 3))
    assert stop_reason([boom], True, 0, 2, 3) is None


def test_a_job_that_has_trained_restarts_a_failure_before_the_attempts_first_step() -> None:
    # Attempt 0 trained and saved step 40; attempt 1's rank 1 was killed in start-up.
    trained_at = Fault("killed", 1, "-9 (SIGKILL)", 43, "rank 1 was killed at step 43", 0, saved=40)
    in_startup = Fault("killed", 1, "-9 (SIGKILL)", None, "rank 1 was killed", 1, saved=40)
    rule = trained(40, 43)
    assert rule == "the job has trained (checkpoint at step 40)"
    assert stop_reason([trained_at, in_startup], rule is not None, 1, 60, 3) is None
    # No checkpoint, but an attempt took steps: trained all the same.
    assert trained(-1, 7) == "the job has trained (to step 7, no checkpoint yet)"
    # Never trained: no attempt took a step, no checkpoint.
    assert trained(-1, -1) is None
    why = stop_reason([in_startup], False, 0, 60, 3)
    assert why is not None and "failed before its first step" in why
    # A failure that would come again or a divergence stops even a job that has trained.
    again = Fault("exited", 0, "2", None, "rank 0 exited with code 2", 1, True, saved=40)
    assert "would fail the same way" in str(stop_reason([trained_at, again], True, 1, 60, 3))
    split = Fault("diverged", 1, "diverged", 44, "rank 1 diverged", 1, saved=40)
    assert "diverged" in str(stop_reason([trained_at, split], True, 1, 60, 3))


def test_a_crash_loop_is_attempts_that_save_nothing_new_whatever_their_failures() -> None:
    def fault(rank: int, saved: int, message: str = "boom") -> Fault:
        return Fault("raised", rank, message, None, f"rank {rank} raised {message}", saved=saved)

    # Different failures, no new checkpoint in 3 attempts: a crash loop.
    mixed = [fault(0, 8), fault(1, 8, "other"), fault(0, 8, "third"), fault(1, 8)]
    assert not crash_loop(mixed, repeats=3) and no_new_save(mixed, repeats=3)
    why = stop_reason(mixed, True, 3, 60, 3)
    assert why == (
        "3 failed attempts in a row (a crash loop), none of them saved a new checkpoint (the "
        "newest is step 8): restarting would not get further"
    )
    # The same failure over and over, each attempt saving further: the job progresses.
    moving = [fault(1, 4), fault(1, 8), fault(1, 12)]
    assert crash_loop(moving, repeats=3) and not no_new_save(moving, repeats=3)
    assert stop_reason(moving, True, 3, 60, 3) is None
    # One attempt that saved resets the count; the first attempts count from no checkpoint.
    assert not no_new_save([fault(0, 8), fault(0, 8), fault(0, 12), fault(0, 12)], repeats=3)
    assert no_new_save([fault(0, -1)] * 3, repeats=3)
    assert not no_new_save([fault(0, 4), fault(0, 4), fault(0, 4)], repeats=3)
    assert not no_new_save([fault(0, -1)] * 2, repeats=3)


def test_a_failure_that_would_repeat_is_not_restarted(tmp_path: Path) -> None:
    # gpukit train exits 2 on bad input and on a checkpoint the disk refused
    exited = RankEnd(0, 2, 1_000, step=6).fault(0)
    assert exited.will_repeat
    assert "restarting would fail the same way" in str(stop_reason([exited], True, 0, 2, 3))
    # a script's own uncaught CheckpointWriteError / ConfigError, as the runner records it
    record = tmp_path / "error.json"
    extra = '"extraInfo": {"time_ns": "5", "will_repeat": true}'
    record.write_text('{"message": {"message": "CheckpointWriteError: could not", ' + extra + "}}")
    error = read_error(record)
    assert error is not None and error.will_repeat
    raised = RankEnd(1, 1, 1_000, error, step=6).fault(0)
    assert raised.will_repeat and stop_reason([raised], True, 0, 2, 3) is not None
    # an ordinary crash is still restarted
    crashed = RankEnd(1, 1, 1_000, ErrorRecord("RuntimeError: boom", 5), step=6).fault(0)
    assert not crashed.will_repeat and stop_reason([crashed], True, 0, 2, 3) is None


def test_the_work_redone_counts_from_the_checkpoint() -> None:
    assert redone(6, 4) == "2 step(s) since the checkpoint at step 4 are redone"
    assert redone(6, -1) == "6 step(s) since the start are redone (no checkpoint yet)"
    assert "unknown" in redone(None, -1)


def beat(rank: int, t: float, step: int, phase: str, saved: int = -1) -> Beat:
    return Beat(rank, t, step, saved, 100 + rank, phase, False, 0)


def test_progress_knows_where_the_attempt_began_and_when_it_first_moved() -> None:
    p = Progress(started=10.0, ranks=2)
    p.observe(beat(0, 11.0, 0, "start"))
    p.observe(beat(0, 11.5, 4, "load", saved=4))  # resumed from the checkpoint at step 4
    p.observe(beat(0, 12.0, 4, "forward", saved=4))
    assert not p.advanced and p.startup_s() is None  # rank 1 has not beaten yet
    p.observe(beat(1, 12.5, 4, "forward", saved=4))
    assert not p.advanced and p.startup_s() == 2.5
    p.observe(beat(1, 13.5, 5, "forward", saved=4))
    assert p.advanced and p.resume_s() == 1.0
    assert (p.step, p.checkpoint) == (5, 4)


def test_a_rank_that_never_beat_has_not_started() -> None:
    p = Progress(started=0.0, ranks=2)
    assert not p.advanced and p.step is None and p.checkpoint == -1


def test_steps_taken_between_two_reads_still_count() -> None:
    p = Progress(started=0.0, ranks=1)  # a fresh start: from step 0
    p.observe(beat(0, 1.0, 2, "optimizer"))  # the first beat read is already at step 2
    assert p.advanced
    resumed = Progress(started=0.0, ranks=1, resumes_from=4)  # after a checkpoint at step 4
    resumed.observe(beat(0, 1.0, 4, "forward"))
    assert not resumed.advanced
    resumed.observe(beat(0, 2.0, 5, "forward"))
    assert resumed.advanced
    restarted = Progress(started=0.0, ranks=1, resumes_from=4)  # a script that starts over
    restarted.observe(beat(0, 1.0, 1, "forward"))  # below 4: it began at 0
    assert restarted.advanced


def test_restart_lines() -> None:
    fault = Fault("killed", 1, "", 6, "rank 1 was killed by SIGKILL at step 6")
    r = Restart(1, fault, redone(6, 4), 1.25, 2.0, None)
    assert r.line(2) == (
        "restart 1/2 after rank 1 was killed by SIGKILL at step 6; 2 step(s) since the "
        "checkpoint at step 4 are redone"
    )
    assert "stopping 1.2 s" in r.timing() and "2.0 s (import + rendezvous)" in r.timing()
    assert "n/a (setup + resume)" in r.timing()
    early = Fault("killed", 1, "", None, "rank 1 was killed by SIGKILL")
    rule = "the job has trained (checkpoint at step 40)"
    r = Restart(3, early, redone(40, 40), 0.5, rule=rule, early=True)
    assert r.line(60) == (
        "restart 3/60 after rank 1 was killed by SIGKILL before the attempt's first step; 0 "
        "step(s) since the checkpoint at step 40 are redone; the job has trained (checkpoint "
        "at step 40): restarting"
    )


def test_the_hang_blames_the_rank_furthest_behind_then_the_oldest_beat() -> None:
    watches = [
        Watch(0, 100.0, 5, "collective"),
        Watch(1, 104.0, 5, "forward"),
        Watch(2, 101.0, 5, "forward"),
        Watch(3, 90.0, 6, "loop"),
    ]
    assert blame(watches, now=105.0, timeout=30) is None
    assert blame(watches, now=125.0, timeout=30).rank == 2  # type: ignore[union-attr]
    # A rank that never beat counts as step -1, phase "start", from its start time.
    late = [*watches, Watch(4, 102.0, -1, "start")]
    assert blame(late, now=125.0, timeout=30).rank == 4  # type: ignore[union-attr]


DUMP = """Thread 0x00007f0000000001 (most recent call first):
  File "{stdlib}/threading.py", line 331 in wait
  File "{stdlib}/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "{site}/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{site}/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{user}", line 21 in main
  File "{user}", line 24 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "/somewhere/gpukit/launch/_launched_script.py", line 147 in <module>
"""


def test_a_dump_is_read_for_the_main_thread_and_the_users_line(tmp_path: Path) -> None:
    paths = sysconfig.get_paths()
    user = str(tmp_path / "train.py")
    text = DUMP.format(stdlib=paths["stdlib"], site=paths["purelib"], user=user)
    frames = main_stack(text)
    assert frames[0] == Frame(
        f"{paths['purelib']}/torch/distributed/distributed_c10d.py", 3252, "all_reduce"
    )
    assert user_frame(frames) == Frame(user, 21, "main")
    assert frames[0].show() == "torch/distributed/distributed_c10d.py:3252 in all_reduce"


def test_the_hang_report_names_the_stuck_line_and_what_the_others_wait_in(tmp_path: Path) -> None:
    paths = sysconfig.get_paths()
    user = str(tmp_path / "train.py")
    waiting = main_stack(DUMP.format(stdlib=paths["stdlib"], site=paths["purelib"], user=user))
    stuck = [Frame(f"{paths['stdlib']}/time.py", 5, "sleepy"), Frame(user, 7, "stall")]
    watches = [Watch(0, 80.0, 3, "collective"), Watch(1, 79.0, 3, "loop")]
    report = hang_report(watches[1], watches, {0: waiting, 1: stuck}, 100.0, "gpukit launch")
    assert report.splitlines() == [
        f"gpukit launch: rank 1 hung: no heartbeat for 21 s at step 3 (phase loop), at {user}:7 "
        "in stall (innermost: time.py:5 in sleepy)",
        "  rank 0: waits in all_reduce (torch/distributed/distributed_c10d.py:3252), called "
        f"from {user}:21 in main; last beat 20 s ago at step 3 (phase collective)",
    ]
    alone = hang_report(Watch(1, 70.0, -1, "start"), watches, {}, 100.0, "x")
    assert alone.startswith("x: rank 1 hung: no heartbeat in the 30 s since it started (no stack")


def test_error_records_are_read_in_torchruns_format(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": {"message": "KeyError: 1", "extraInfo": {"time_ns": "42"}}}')
    assert read_error(path) == ErrorRecord("KeyError: 1", 42)
    path.write_text("not json")
    assert read_error(path) is None
    assert read_error(tmp_path / "missing.json") is None


@pytest.mark.parametrize(
    ("code", "words"),
    [(1, "1"), (0, "0"), (-6, "-6 (SIGABRT)"), (-9, "-9 (SIGKILL)"), (-99, "-99 (signal 99)")],
)
def test_exit_codes_name_their_signal(code: int, words: str) -> None:
    assert describe_exit(code) == words


def test_paths_are_shown_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Frame(str(tmp_path / "sub" / "train.py"), 3, "f").show() == os.path.join(
        "sub", "train.py:3 in f"
    )


def test_the_rank_outside_the_majority_of_collectives_diverged() -> None:
    ar, bw = "rt.all_reduce at train.py:17", "rt.backward at train.py:13"
    ends = [
        RankEnd(0, -6, 1, step=4, where_called=ar, calls=9),  # gloo aborted this one: a victim
        RankEnd(
            1, 1, 2, ErrorRecord("DistributedError: collective failed"), where_called=ar, calls=9
        ),
        RankEnd(2, -9, 3, stopped=True, step=4, where_called=bw, calls=9),
    ]
    rank, text = diverged(ends)  # type: ignore[misc]
    assert rank.rank == 2
    assert text == f"diverged at step 4: it went on to {bw} while ranks 0, 1 wait in {ar}"
    assert failures(ends)[0].rank == 2
    assert headline(ends, "x").startswith(f"x: rank 2 {text} — the first failure")
    assert ends[2].fault(0, ends).kind == "diverged"


def test_two_ranks_that_disagree_are_both_named_without_blame() -> None:
    ends = [
        RankEnd(0, -6, 1, step=4, where_called="rt.all_reduce at train.py:17", calls=21),
        RankEnd(1, -6, 2, step=4, where_called="rt.broadcast at train.py:19", calls=21),
    ]
    assert diverged(ends)[1] == (  # type: ignore[index]
        "disagrees with rank 0 at step 4, at the 21st call where ranks meet: "
        "it is in rt.broadcast at train.py:19, rank 0 in rt.all_reduce at train.py:17 (one of "
        "them skipped a call the other made, or made one more)"
    )


def test_no_divergence_is_claimed_without_proof() -> None:
    where = ["rt.all_reduce at train.py:17", "rt.backward at train.py:13"]
    raised = [
        RankEnd(0, 1, 1, ErrorRecord("ValueError: bad batch"), where_called=where[0], calls=5),
        RankEnd(1, -9, 2, stopped=True, where_called=where[1], calls=5),
    ]
    killed = [  # the kernel's out-of-memory killer: not a collective that broke
        RankEnd(0, -9, 1, where_called=where[0], calls=5),
        RankEnd(1, -6, 2, where_called=where[1], calls=5),
    ]
    # rank 0 aborted on its own after its step; rank 1 waits one call further on
    aborted = [
        RankEnd(0, -6, 1, where_called="rt.step at train.py:11", calls=12),
        RankEnd(
            1,
            1,
            2,
            ErrorRecord("DistributedError: connection closed"),
            where_called=where[1],
            calls=13,
        ),
    ]
    same = [RankEnd(r, -6, r, where_called=where[0], calls=5) for r in (0, 1)]
    assert all(diverged(e) is None for e in (raised, killed, aborted, same))


def test_a_heartbeat_file_the_disk_refuses_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its blocks are taken when it is made: a full disk is refused there, not met later by a
    # beat's write to the map (a SIGBUS that kills the rank without a word).
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(OutputWriteError) as caught:
        Heartbeat(tmp_path, 0)
    message = str(caught.value)
    assert str(tmp_path / "beat-0") in message and "(ENOSPC)" in message
    assert "TMPDIR" in message
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(OutputWriteError, match=r"\(ENOTDIR\)"):
        Heartbeat(blocker, 1)
