"""gpukit's launcher with real processes (gloo, 2 ranks on 127.0.0.1): restarts on a fresh
port, when not to restart, the first failure named, hangs, signals, and no orphans.

The scripts beat through ``Heartbeat.from_env()`` themselves, as a gpukit Runtime would."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpukit

# Signals, grace periods and hang timeouts: one at a time under `make test`.
pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("timing")]

GPUKIT = Path(gpukit.__file__).resolve().parent

# A tutorial-style DDP script. argv[1]: the output folder; argv[2]: what to do per attempt,
# e.g. "0=kill,1=raise" (rank FAIL_RANK, default 1, fails so at step 2 of attempts 0 and 1).
TRAIN = """
import os, signal, sys
import torch, torch.distributed as dist
from gpukit.launch.heartbeat import Heartbeat

out, plan = sys.argv[1], dict(p.split("=") for p in sys.argv[2].split(",") if p)
beats = Heartbeat.from_env()
beats.beat("start", 0)
attempt = int(os.environ["GPUKIT_ATTEMPT"])
mode = plan.get(str(attempt))
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    with open(os.path.join(out, f"port-{attempt}"), "w") as f:
        f.write(os.environ["MASTER_PORT"])
for step in range(4):
    beats.beat("forward", step)
    total = torch.ones(1)
    dist.all_reduce(total)
    beats.beat("optimizer", step)
    if step == 1:
        beats.saved(1)
    if step == 2 and rank == int(os.environ.get("FAIL_RANK", "1")) and mode:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)
        raise ValueError(f"bad batch at step {step}")
beats.beat("end", 4)
dist.barrier()
dist.destroy_process_group()
"""

# Ranks that only beat: the heartbeat writer is loaded without gpukit's package __init__ (which
# imports torch), so each attempt starts in a blink. argv as TRAIN's; rank 1 fails at step 2,
# and with "stay" in the plan rank 0 waits to be stopped rather than finish.
LIGHT = """
import os, signal, sys, time, types
for name, sub in (("gpukit", ""), ("gpukit.runtime", "runtime")):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(GPUKIT, sub)]
    sys.modules[name] = package
from gpukit.launch.heartbeat import Heartbeat

out, plan = sys.argv[1], dict(p.split("=") for p in sys.argv[2].split(",") if p)
attempt, rank = int(os.environ["GPUKIT_ATTEMPT"]), int(os.environ["RANK"])
if rank == 0:
    with open(os.path.join(out, f"port-{attempt}"), "w") as f:
        f.write(os.environ["MASTER_PORT"])
mode = plan.get(str(attempt))
beats = Heartbeat.from_env()
beats.beat("start", 0)
for step in range(4):
    beats.beat("forward", step)
    time.sleep(0.02)
    beats.beat("optimizer", step)
    if step == 2 and rank == 1 and mode:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)
        raise ValueError(f"bad batch at step {step}")
if mode and "stay" in plan:
    time.sleep(30)  # until the launcher stops it, after rank 1's failure
"""

HANG = """
import time
import torch, torch.distributed as dist
from gpukit.launch.heartbeat import Heartbeat


def stall():
    while True:
        time.sleep(0.5)  # line 9


def main():
    beats = Heartbeat.from_env()
    dist.init_process_group("gloo")  # first: ranks that import at different speeds meet here
    beats.beat("start", 0)
    for step in range(1000):
        beats.beat("loop", step)
        if dist.get_rank() == 1 and step == 3:
            stall()
        beats.beat("collective", step)
        dist.all_reduce(torch.ones(1))  # line 21


main()
"""

# Light ranks (as LIGHT) for start-up. argv[1]: the output folder; argv[2]: what rank 1 does
# before its first beat: "forever" (it never beats), or seconds past rank 0's first beat.
STARTS = """
import os, sys, time, types
for name, sub in (("gpukit", ""), ("gpukit.runtime", "runtime")):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(GPUKIT, sub)]
    sys.modules[name] = package
from gpukit.launch.heartbeat import Heartbeat

out, late = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
beats = Heartbeat.from_env()


def here(name):
    return os.path.exists(os.path.join(out, name))


def wait_for(name):
    while not here(name):
        time.sleep(0.05)


def slow_import():
    open(os.path.join(out, "importing"), "w").close()
    if late == "forever":
        while True:
            time.sleep(0.5)  # the stall
    wait_for("beat-0")
    first = float(open(os.path.join(out, "beat-0")).read())
    while time.time() - first < float(late):
        time.sleep(0.05)


if rank == 1:
    slow_import()
else:
    wait_for("importing")  # signalled only once both ranks run the script
beats.beat("start", 0)
with open(os.path.join(out, f"beat-{rank}.tmp"), "w") as f:
    f.write(str(time.time()))
os.replace(os.path.join(out, f"beat-{rank}.tmp"), os.path.join(out, f"beat-{rank}"))
wait_for(f"beat-{1 - rank}")  # the rendezvous: rank 0 waits here for rank 1
for step in range(3):
    beats.beat("loop", step)
    time.sleep(0.01)
"""

# No torch: a rank that saves and exits 143 on SIGTERM, after writing its pid (whole, by a
# rename: the test reads it as soon as it appears).
WAIT = """
import os, signal, sys, time
out = sys.argv[1]
def stop(sig, frame):
    open(os.path.join(out, "term-" + os.environ["RANK"]), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
with open(os.path.join(out, "job-dir"), "w") as f:
    f.write(os.environ["GPUKIT_JOB_DIR"])
aside = os.path.join(out, "tmp-" + os.environ["RANK"])
with open(aside, "w") as f:
    f.write(str(os.getpid()))
os.replace(aside, os.path.join(out, "pid-" + os.environ["RANK"]))
while True:
    time.sleep(0.05)
"""


def launch(
    script: Path, *flags: str, args: tuple[str, ...] = (), timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """``gpukit launch --nproc 2 FLAGS script ARGS`` to its end; a hang guard fails the test."""
    command = [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", *flags, str(script)]
    try:
        return subprocess.run(
            [*command, *args],
            text=True,
            capture_output=True,
            timeout=timeout,
            cwd=script.parent,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"gpukit launch did not end within {timeout} s:\n{err.stderr}")


def run_train(
    tmp_path: Path, plan: str, *flags: str, timeout: float = 90, light: bool = False
) -> subprocess.CompletedProcess[str]:
    """TRAIN (or LIGHT), failing as ``plan`` says, under ``gpukit launch --nproc 2 FLAGS``."""
    script = tmp_path / "train.py"
    script.write_text(f"GPUKIT = {str(GPUKIT)!r}\n{LIGHT}" if light else TRAIN)
    return launch(script, *flags, args=(str(tmp_path), plan), timeout=timeout)


def ports(tmp_path: Path) -> list[str]:
    return [p.read_text() for p in sorted(tmp_path.glob("port-*"))]


def assert_headline(err: str, attempt: int, words: str) -> None:
    """Attempt ``attempt``'s first line names rank 1, which failed at step 2 in the way
    ``words`` says, although rank 0 then failed too, on the broken connection (or was
    stopped); then one line per rank, rank 1's first."""
    heads = [line for line in err.splitlines() if line.startswith("gpukit launch: rank")]
    head = heads[attempt]
    assert head.startswith(f"gpukit launch: rank 1 {words} at step 2 (phase optimizer) — "), err
    assert re.search(r"the first failure; rank 0 (failed after it|stopped)$", head), head
    lines = err[err.index(head) :].splitlines()
    assert lines[1].startswith("  rank 1 at step 2 (phase optimizer): ")
    assert lines[2].startswith("  rank 0 ")


def test_restarts_twice_in_a_row_on_fresh_ports_then_succeeds(tmp_path: Path) -> None:
    done = run_train(tmp_path, "0=kill,1=raise", "--max-restarts", "2")
    err = done.stderr
    assert done.returncode == 0, err
    assert len(set(ports(tmp_path))) == 3  # a fresh port each attempt
    assert_headline(err, 0, "was killed by SIGKILL")
    assert_headline(err, 1, "raised ValueError: bad batch at step 2")
    # Rank 0 may have begun step 3 when rank 1 died: the steps redone count from there.
    assert re.search(
        r"gpukit launch: restart 1/2 after rank 1 was killed by SIGKILL at step 2 \(phase "
        r"optimizer\); [12] step\(s\) since the checkpoint at step 1 are redone",
        err,
    ), err
    assert "gpukit launch: restart 2/2 after rank 1 raised ValueError: bad batch at step 2" in err
    summary = err[err.index("gpukit launch: done after 2 restart(s)") :].splitlines()
    assert summary[0].endswith(
        "the job's first fault: rank 1 was killed by SIGKILL at step 2 (phase optimizer) "
        "(attempt 0)"
    )
    assert summary[1].startswith("  restart 1: stopping ") and "(import + rendezvous)" in summary[1]
    assert summary[2].startswith("  restart 2: stopping ")


def test_when_restarts_run_out_the_summary_names_the_jobs_first_fault(tmp_path: Path) -> None:
    done = run_train(tmp_path, "0=exit,1=kill,stay=1", "--max-restarts", "1", light=True)
    err = done.stderr
    assert done.returncode == 1, err
    # Rank 0 did not fail: it was stopped.
    assert (
        "gpukit launch: rank 1 exited with code 3 at step 2 (phase optimizer) — the first "
        "failure; rank 0 stopped\n" in err
    )
    assert "  rank 0 at step 3 (phase optimizer): stopped by the launcher\n" in err
    assert "gpukit launch: not restarted: no restarts left (all 1 used)" in err
    last = err[err.index("gpukit launch: failed after 1 restart(s)") :].splitlines()[0]
    assert last.endswith(
        "the job's first fault: rank 1 exited with code 3 at step 2 (phase optimizer) (attempt 0)"
    )


def test_a_failure_before_the_first_step_is_not_restarted(tmp_path: Path) -> None:
    script = tmp_path / "early.py"  # it never beats: it has not begun
    script.write_text("raise ImportError(\"no module named 'missing'\")\n")
    done = launch(script, "--max-restarts", "3")
    assert done.returncode == 1, done.stderr
    assert re.search(
        r"gpukit launch: rank [01] raised ImportError: no module named .missing.", done.stderr
    )
    assert (
        "gpukit launch: not restarted: it failed before its first step: restarting would fail "
        "the same way" in done.stderr
    )
    assert "restart 1/" not in done.stderr


def test_the_same_failure_three_times_is_a_crash_loop(tmp_path: Path) -> None:
    plan = ",".join(f"{a}=raise" for a in range(6))
    done = run_train(tmp_path, plan, "--max-restarts", "5", light=True)
    assert done.returncode == 1, done.stderr
    assert "the same failure 3 times in a row (a crash loop)" in done.stderr
    assert len(ports(tmp_path)) == 3  # stopped early: attempts 3..5 never ran


def test_different_failures_that_save_nothing_three_times_are_a_crash_loop(
    tmp_path: Path,
) -> None:
    # Each attempt trains to step 2 and fails another way; none saves: no attempt gets further.
    done = run_train(tmp_path, "0=kill,1=exit,2=raise,3=kill", "--max-restarts", "5", light=True)
    assert done.returncode == 1, done.stderr
    assert (
        "gpukit launch: not restarted: 3 failed attempts in a row (a crash loop), none of them "
        "saved a new checkpoint (there is none): restarting would not get further"
    ) in done.stderr
    assert "; the job has trained (to step " in done.stderr, done.stderr
    assert len(ports(tmp_path)) == 3  # stopped early: attempts 3..5 never ran


def test_a_hang_names_the_stuck_rank_its_line_and_what_the_other_waits_in(
    tmp_path: Path,
) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    # The hang clock starts at the first beat, once both ranks have beaten: importing torch on
    # a loaded machine takes no part in it. 5 s: far more than a healthy step of this loop
    # (two beats and a one-number all-reduce, milliseconds even on a loaded machine).
    done = launch(script, "--hang-timeout", "5", timeout=180)  # a guard only
    err = done.stderr
    assert done.returncode == 1, err
    assert re.search(
        r"gpukit launch: rank 1 hung: no heartbeat for \d+ s at step 3 \(phase loop\), at "
        r"hang\.py:9 in stall",
        err,
    ), err
    assert re.search(
        r"  rank 0: waits in all_reduce \(torch/distributed/\S+\), called from hang\.py:21 in "
        r"main; last beat \d+ s ago at step 3 \(phase collective\)",
        err,
    ), err
    kept = Path(re.search(r"hang-report\.txt are kept in (\S+)", err)[1])  # type: ignore[index]
    try:
        assert {p.name for p in kept.glob("stack-*")} == {"stack-0-0.txt", "stack-1-0.txt"}
        assert "in stall" not in (kept / "stack-0-0.txt").read_text()
        assert 'hang.py", line 9 in stall' in (kept / "stack-1-0.txt").read_text()
        assert "rank 1 hung" in (kept / "hang-report.txt").read_text()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def starts(tmp_path: Path, late: str, *flags: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "starts.py"
    script.write_text(f"GPUKIT = {str(GPUKIT)!r}\n{STARTS}")
    return launch(script, *flags, args=(str(tmp_path), late), timeout=180)


def test_a_rank_that_never_beats_is_named_after_the_startup_timeout_not_its_waiting_peer(
    tmp_path: Path,
) -> None:
    # Rank 0 beats and waits for rank 1, which never beats: past the start-up timeout rank 1
    # is named with its line, while rank 0, waiting longer than the hang timeout, is not blamed.
    done = starts(
        tmp_path, "forever", "--hang-timeout", "1", "--startup-timeout", "3", "--max-restarts", "2"
    )
    err = done.stderr
    assert done.returncode == 1, err
    stall = 1 + STARTS.splitlines().index("            time.sleep(0.5)  # the stall") + 1
    assert re.search(
        r"gpukit launch: rank 1 did not start: no heartbeat in the \d+ s since it started "
        rf"\(start-up timeout 3 s\), at starts\.py:{stall} in slow_import",
        err,
    ), err
    assert re.search(
        r"  rank 0: waits in (<module>|wait_for|here) \(starts\.py:\d+\)(, called from \S+)?; "
        r"last beat \d+ s ago at step 0 \(phase start\)",
        err,
    ), err
    assert "hung" not in err and "restart 1/2" not in err, err
    assert "not restarted: it failed before its first step" in err, err
    kept = Path(re.search(r"hang-report\.txt are kept in (\S+)", err)[1])  # type: ignore[index]
    try:
        assert "rank 1 did not start" in (kept / "hang-report.txt").read_text()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_a_rank_that_waits_for_a_slow_starter_longer_than_the_hang_timeout_is_not_hung(
    tmp_path: Path,
) -> None:
    # Rank 1 first beats 5 s after rank 0 did, 2 s past the hang timeout: rank 0 waited for it
    # (the rendezvous), it did not hang; then both run to the end. The ranks' exits count
    # against the hang timeout too (their last beat is the loop's): 3 s leaves them room on a
    # loaded machine.
    done = starts(tmp_path, "5", "--hang-timeout", "3")
    assert done.returncode == 0, done.stderr
    assert "hung" not in done.stderr and "did not start" not in done.stderr, done.stderr


def start_waiting_job(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    job = subprocess.Popen(
        [sys.executable, "-m", "gpukit", "launch", "--nproc", "2", str(script), str(tmp_path)],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid-*"))) < 2:
        if time.monotonic() > deadline or job.poll() is not None:
            job.kill()
            pytest.fail(f"the ranks did not start:\n{job.communicate()[0]}")
        time.sleep(0.05)
    # Each pid file appears whole (written aside, then renamed): no wait for the writes.
    return job, [int(p.read_text()) for p in sorted(tmp_path.glob("pid-*"))]


def gone(pid: int) -> bool:
    """Ended (a zombie waiting for whoever adopted it to reap it counts)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def test_sigterm_reaches_every_rank_which_saves_and_the_launcher_exits_143(
    tmp_path: Path,
) -> None:
    job, _ = start_waiting_job(tmp_path)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=60)
    assert job.returncode == 143, output
    assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists()
    assert "gpukit launch: stopped on request (exit 143)" in output


@pytest.mark.cold_start
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_the_launcher_even_when_it_is_sigkilled(tmp_path: Path) -> None:
    job, pids = start_waiting_job(tmp_path)
    job.kill()
    job.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [pid for pid in pids if not gone(pid)]
    for pid in alive:  # do not leave them behind, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    # A launcher killed so has no chance to remove its job folder.
    shutil.rmtree((tmp_path / "job-dir").read_text(), ignore_errors=True)
    assert not alive
    assert not (tmp_path / "term-0").exists()  # killed, not asked to stop


RELAY = """
import os, signal, sys, time, types
for name, sub in (("gpukit", ""), ("gpukit.runtime", "runtime")):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(GPUKIT, sub)]
    sys.modules[name] = package
from gpukit.launch.heartbeat import Heartbeat
out = sys.argv[1]
beats = Heartbeat.from_env()
beats.beat("start", 0)
def stop(sig, frame):
    open(os.path.join(out, "term-" + os.environ["RANK"]), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    beats.request_stop()  # as a rank does when the scheduler signals it alone
    time.sleep(0.5)
    sys.exit(143)
while True:
    beats.beat("loop", 0)
    time.sleep(0.05)
"""


def test_a_stop_one_rank_was_asked_for_is_relayed_to_the_others(tmp_path: Path) -> None:
    script = tmp_path / "relay.py"
    script.write_text(f"GPUKIT = {str(GPUKIT)!r}\n{RELAY}")
    done = launch(script, "--max-restarts", "2", args=(str(tmp_path),))
    assert done.returncode == 143, done.stderr
    assert (tmp_path / "term-0").exists()  # rank 0 got SIGTERM from the launcher
    assert "restart" not in done.stderr  # a preemption is not restarted


# Rank 1 skips a collective the others make (a `continue` under `if rank == 1`): gloo aborts on
# rank 0, the victim; the report must name rank 1 and both ranks' lines.
SKIPS = """import torch
from torch import nn
import gpukit as gk

rt = gk.Runtime(seed=0)
model = nn.Linear(8, 1)
model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(10):
    loss = nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
    rt.backward(loss)
    rt.step(opt)
    if rt.rank == 1 and step == 3:
        continue
    mean = rt.all_reduce(loss.detach())
rt.teardown()
"""


def test_a_rank_that_skips_a_collective_is_named_with_both_ranks_lines(tmp_path: Path) -> None:
    # Two ranks: gloo aborts on the mismatch. (Three ranks in a ring may wait instead: then
    # the hang report names where each rank is.)
    nproc = 2
    script = tmp_path / "skips.py"
    script.write_text(SKIPS)
    command = [sys.executable, "-m", "gpukit", "launch", "--nproc", str(nproc)]
    done = subprocess.run(
        [*command, "--max-restarts", "1", str(script)],
        text=True,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    err = done.stderr
    assert done.returncode == 1, err
    skipped, waits = "rt.backward at skips.py:10", "rt.all_reduce at skips.py:14"
    # Nothing tells which of two ranks left the other: both are named as such (a majority of
    # three or more names the one that diverged: test_agent_rules).
    said = "gpukit launch: rank 1 disagrees with rank 0 at step 4, at the "
    assert said in err and f"it is in {skipped}, rank 0 in {waits}" in err, err
    assert f"  rank 1 at step 4 (phase backward), in {skipped}" in err, err
    assert f"  rank 0 at step 4 (phase collective), in {waits}" in err, err
    assert "not restarted: the ranks' collectives diverged" in err, err
    assert err.count("  rank 1 at step 4") == 1, err
