"""The tests' own harness for plain reference programs (tests/ranks.py, tests/fakes.py): a
reference whose port another process took in the meantime is run again on a fresh port, and
any other failure still fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.fakes import spawn_plain_program
from tests.ranks import PORT_TAKEN, RankFailed, start_processes

pytestmark = pytest.mark.processes


def _taken_once(rank: int, port: int, folder: str) -> None:
    """Fails as gloo does on a taken port the first time rank 0 runs, then succeeds."""
    tried = Path(folder, "tried")
    if rank == 0 and not tried.exists():
        tried.touch()
        raise RuntimeError(f"failed to listen on port {port}, code: -98, name: EADDRINUSE")
    Path(folder, f"done-{rank}-{port}").touch()


def _fails(rank: int, port: int, folder: str) -> None:
    Path(folder, f"tried-{port}").touch()
    raise ValueError(f"rank {rank}: a mistake of the program's own")


def test_a_reference_whose_port_was_taken_runs_again_on_a_fresh_port(tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as failed:
        start_processes(_taken_once, (0, str(tmp_path)), 1)
    assert failed.value.exit_code == PORT_TAKEN
    (tmp_path / "tried").unlink()
    spawn_plain_program(_taken_once, str(tmp_path), 2)
    # Rank 1 of the first try may have been ended before it got that far.
    (last,) = (p.name.rsplit("-", 1)[1] for p in tmp_path.glob("done-0-*"))
    assert (tmp_path / f"done-1-{last}").exists()


def test_any_other_failure_of_a_reference_fails_at_once(tmp_path: Path) -> None:
    # Forked warm, the rank's exit code says it; spawned cold, torch's own error carries it.
    with pytest.raises((RankFailed, mp.ProcessRaisedException)):
        spawn_plain_program(_fails, str(tmp_path), 2)
    assert len(list(tmp_path.glob("tried-*"))) == 1  # one port: not tried again
