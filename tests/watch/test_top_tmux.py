"""`gpukit top` on a real terminal (a tmux pane): it shows the ranks, follows the steps as the
launcher's view changes, quits on q and on Ctrl-C, and leaves the terminal as it found it."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.watch.live_views import Publisher, job_folder
from tests.watch.terminals import Pane, tmux_pane

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


@pytest.fixture
def pane() -> Iterator[Pane]:
    with tmux_pane() as pane:
        yield pane


def shown_step(screen: str) -> int | None:
    found = re.search(r"2 nodes x 2 ranks  step (\d+)/200", screen)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("quit_key", ["q", "C-c"])
def test_top_follows_the_job_and_quits_leaving_the_terminal_as_it_was(
    pane: Pane, tmp_path: Path, quit_key: str
) -> None:
    folder = job_folder(tmp_path)
    top = shlex.join([sys.executable, "-m", "gpukit", "top", "--job", str(folder)])
    before, after = tmp_path / "before", tmp_path / "after"
    # The terminal's settings are saved before and after top, and compared.
    line = f"stty -g > {before}; {top} --interval 0.2; echo $? > {tmp_path / 'code'}; "
    line += f"stty -g > {after}"
    with Publisher(folder, period=0.2) as publisher:
        pane.type(line, "Enter")
        pane.wait_for("the ranks", lambda: " 1 slow " in pane.screen())
        screen = pane.screen()
        first = shown_step(screen)
        assert first is not None, screen
        assert "node-b" in screen and "last events:" in screen and "q or Ctrl-C quits" in screen
        pane.wait_for("a later step", lambda: (shown_step(pane.screen()) or 0) > first)
        assert pane.command() != "bash"  # top runs in the pane
        pane.type(quit_key)
        pane.wait_for("top to quit", after.exists)
        assert publisher.step > first
    pane.wait_for("the shell", lambda: pane.command() == "bash")
    assert (tmp_path / "code").read_text().strip() == "0"
    assert after.read_text() == before.read_text()
    assert "Traceback" not in pane.screen()
