"""A real terminal for `gpukit top`: one tmux pane running bash, on a tmux server of its own,
that a test types into and reads the screen of."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


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


@contextmanager
def tmux_pane(width: int = 200, height: int = 50) -> Iterator[Pane]:
    """A pane ``width`` x ``height`` running a bare bash; its server is killed at the end."""
    socket = f"gpukit-top-{os.getpid()}-{secrets.token_hex(4)}"  # one per test, across workers
    pane = Pane(socket)
    shell = "env PS1='$ ' bash --norc --noprofile"
    pane.tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), shell)
    try:
        yield pane
    finally:
        subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, timeout=30)
