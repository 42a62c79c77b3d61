"""What the launcher says of a job stopped on request: the checkpoint it names is the newest of
the whole job, not only of the attempt's heartbeats."""

from __future__ import annotations

import pytest

from gpukit.launch.attempt_watch import Outcome
from gpukit.launch.failures import RankEnd
from gpukit.launch.heartbeat import Beat
from gpukit.launch.job import stopped_line
from gpukit.launch.restarts import Progress


def beat(rank: int, t: float, step: int, phase: str, saved: int = -1) -> Beat:
    return Beat(rank, t, step, saved, 100 + rank, phase, False, 0)


@pytest.mark.parametrize(
    ("saved", "said"),
    [
        pytest.param(8, "killed (the newest checkpoint is step 8)", id="an-earlier-attempts"),
        pytest.param(0, "killed (the newest checkpoint is step 0)", id="step-0"),
        pytest.param(-1, "killed (no checkpoint)", id="none"),
    ],
)
def test_a_stop_past_the_grace_names_the_jobs_newest_checkpoint(saved: int, said: str) -> None:
    """Ranks of a restarted attempt killed at the grace before they loaded the checkpoint: their
    heartbeats hold none (-1, or 0 for one still at its start), the job knows the newest."""
    progress = Progress(0.0, 2)
    progress.observe(beat(0, 1.0, 0, "start"))
    progress.observe(beat(1, 1.0, 0, "start"))
    ends = [RankEnd(r, -9, 0, stopped=True) for r in range(2)]
    line = stopped_line("gpukit launch", Outcome("preempted", ends, progress), saved)
    assert line.startswith("gpukit launch: stopped on request (exit 143); the ranks did not")
    assert said in line, line
