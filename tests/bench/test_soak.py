"""`gpukit bench restarts --soak N`, and the launcher under it: a 2-rank `gpukit train` that
kill -9s sent from outside hit at real moments (a restart's start-up, a step, a save) and
SIGTERMs stop, restarted or resumed until it ends with the weights of a run that none hit."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from gpukit.bench import soak
from gpukit.bench.soak import Shot
from gpukit.cli.__main__ import main

STEPS = 24


def test_the_faults_are_drawn_from_the_seed() -> None:
    assert soak.plan(8, seed=3, terms=2) == soak.plan(8, seed=3, terms=2)
    assert soak.plan(8, seed=3) != soak.plan(8, seed=4)
    shots = soak.plan(8, seed=3, terms=2)
    assert [s.signal for s in shots].count("SIGTERM") == 2
    assert all(s.moment == "step" for s in shots if s.signal == "SIGTERM")
    assert {s.moment for s in soak.plan(60, seed=1)} == set(soak.MOMENTS)
    assert {s.rank for s in shots} <= {0, 1}


def test_each_rank_trains_through_the_runner_and_writes_its_pid_first() -> None:
    command = soak.command(Path("/x/run"), steps=4, resume=True)
    assert Path(command[2]).name == "soak_rank.py"
    assert command[3:7] == ["train", "--workload", "mlp", "--strategy"]
    assert command[-3:] == ["--out", "/x/run", "--resume"]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--soak", "0"], "--soak 0: give a whole number of faults, at least 1"),
        (["--seed", "7"], "--seed 7: it seeds --soak N; give --soak too"),
    ],
)
def test_a_bad_soak_is_refused_before_anything_runs(flags: list[str], words: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["bench", "restarts", *flags])
    assert code == 2 and words in err.getvalue(), err.getvalue()


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.xdist_group("timing")
def test_a_rank_killed_in_the_restarts_start_up_is_restarted_and_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    # Rank 1 is killed at a step once the job has saved; then, as the restart starts (its pid
    # written, before its first heartbeat), rank 1 again: that attempt never took a step.
    shots = [Shot("SIGKILL", 1, "step", 1), Shot("SIGKILL", 1, "import")]
    done = soak.soak(2, 0, tmp_path, steps=STEPS, shots=shots)
    out = done.output
    assert done.codes == [0], out
    assert [h.attempt for h in done.hits] == [0, 1], out
    assert done.hits[1].phase == "import", out  # killed before its first beat
    assert "gpukit launch: restart 2/60 after rank 1 was killed by SIGKILL before the " in out
    assert "; the job has trained (checkpoint at step " in out, out
    assert "not restarted" not in out, out
    assert done.bitwise_equal, out


@pytest.mark.processes
@pytest.mark.slow
@pytest.mark.xdist_group("timing")
def test_a_soak_of_kills_and_sigterms_ends_bitwise_equal(tmp_path: Path) -> None:
    done = soak.soak(7, 13, tmp_path, terms=2, steps=STEPS)  # start-up kills among them
    out = done.output
    kills = [h for h in done.hits if h.shot.signal == "SIGKILL"]
    assert len(done.hits) == 7, out
    # Each SIGTERM ended its run with 143 and a save; each rerun with --resume went on.
    assert done.codes == [143, 143, 0], out
    assert len(done.saved_on_stop) == 2 and all(0 < s < STEPS for s in done.saved_on_stop)
    assert done.restarts == len(kills) == 5, out
    assert "before the attempt's first step" in out, out  # a restart's start-up was hit
    assert "not restarted" not in out, out
    assert done.bitwise_equal, out
