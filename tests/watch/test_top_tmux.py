"""`gpukit top` on a real terminal (a tmux pane): it shows the ranks, follows the steps as the
launcher's view changes, quits on q and on Ctrl-C, and leaves the terminal as it found it."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.watch.live_views import Publisher, job_folder

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
]


class Pane:
    """One tmux pane running bash, on a tmux server of its own (a private socket)."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def tmux(self, *args: str) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def type(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def command(self) -> str:
        return self.tmux("display-message", "-p", "-t", "top", "#{pane_current_command}").strip()

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"waited for {what}; the pane:\n{self.screen()}"
            time.sleep(0.1)


@pytest.fixture
def pane() -> Iterator[Pane]:
    socket = f"gpukit-top-{os.getpid()}-{secrets.token_hex(4)}"  # one per test, across workers
    pane = Pane(socket)
    shell = "env PS1='$ ' bash --norc --noprofile"
    pane.tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "50", shell)
    try:
        yield pane
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)


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
