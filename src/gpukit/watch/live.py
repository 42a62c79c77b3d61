"""The loop of ``gpukit top``: read the job's ``live.json`` every interval and show it.

Three ways to show it: a screen redrawn in place on a terminal (rich's Live; ``q`` or Ctrl-C
quits, the keys read in cbreak mode and the terminal put back as it was however the loop ends),
one compact JSON line per interval (``--json``, flushed at once for a pipe), or one screen
(``--once``). Off a terminal without ``--json`` each interval's screen is printed after the
last, as plain text.

A view that cannot be read this tick (half written, unreadable) is read again at the next
one; the loop ends, with one line on stderr, when the job ends or its launcher is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from gpukit import _env
from gpukit.errors import ConfigError
from gpukit.watch.jobs import LIVE_FILE, read_view, stopped
from gpukit.watch.screen import screen

try:
    import termios
    import tty
except ImportError:  # Windows: no cbreak mode; Ctrl-C still quits
    termios = None  # type: ignore[assignment]
    tty = None  # type: ignore[assignment]

Mode = Literal["live", "json", "once"]
QUIT_KEYS = frozenset("qQ")
# --once reads again for this long when the view is being rewritten or not written yet.
ONCE_WAIT_S = 3.0
# Off a terminal, without COLUMNS, the screen is laid out this wide rather than rich's 80
# columns: the rank table drops its least needed columns below about 170.
PLAIN_WIDTH = 180


def watch(folder: Path, *, interval: float = 1.0, mode: Mode = "live") -> int:
    """Show the job in ``folder`` until it ends or the user quits; the exit code: 0 when the
    user quit or the job ended, 1 when its launcher vanished without ending it."""
    if mode == "once":
        return _once(folder)
    if mode == "json":
        return _loop(folder, interval, _print_json, _wait)
    console = _console()
    if not console.is_terminal:
        return _loop(folder, interval, lambda view: _print_screen(console, view), _wait)
    return _live(folder, interval, console)


def _console() -> Console:
    """A console on stdout; off a terminal as wide as ``COLUMNS`` says (``COLUMNS=110 gpukit
    top --once`` for a page or a README), else :data:`PLAIN_WIDTH`."""
    console = Console(highlight=False)
    if console.is_terminal:
        return console
    return Console(highlight=False, width=_env.columns() or PLAIN_WIDTH)


def _once(folder: Path) -> int:
    deadline = time.monotonic() + ONCE_WAIT_S
    view = read_view(folder)
    while view is None and folder.is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
        view = read_view(folder)
    why = stopped(folder, view)
    if view is None:
        raise ConfigError(
            why.line
            if why
            else f"{folder / LIVE_FILE}: could not be read for {ONCE_WAIT_S:.0f} s (not "
            "written yet, or unreadable): try again, or run `gpukit top` without --once"
        )
    _console().print(screen(view))
    if why is not None:
        print(f"gpukit top: {why.line}", file=sys.stderr)
    return 0


Show = Callable[[dict[str, Any]], None]
Wait = Callable[[float], bool]  # waits up to the interval; True when the user asked to quit


def _loop(folder: Path, interval: float, show: Show, wait: Wait) -> int:
    """Read, show, wait, until the job stops or ``wait`` says the user quit."""
    try:
        while True:
            view = read_view(folder)
            why = stopped(folder, view)
            if view is not None:
                show(view)
            if why is not None:
                print(f"gpukit top: {why.line}", file=sys.stderr)
                return 1 if why.killed else 0
            if wait(interval):
                return 0
    except KeyboardInterrupt:  # Ctrl-C: the way to quit off a terminal
        return 0


def _wait(seconds: float) -> bool:
    time.sleep(seconds)
    return False


def _print_json(view: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(view, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _print_screen(console: Console, view: dict[str, Any]) -> None:
    console.print(screen(view))
    console.rule()
    console.file.flush()


def _live(folder: Path, interval: float, console: Console) -> int:
    waiting = Text(f"waiting for {folder / LIVE_FILE} (q quits)")

    keys = Text("q or Ctrl-C quits", style="dim")

    def draw(view: dict[str, Any]) -> None:
        live.update(Group(screen(view), keys), refresh=True)

    with _keys(sys.stdin) as wait, Live(waiting, console=console, auto_refresh=False) as live:
        code = _loop(folder, interval, draw, wait)
    return code


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Wait]:
    """A wait that returns early when ``q`` is pressed: the terminal in cbreak mode (keys come
    one by one, unechoed; Ctrl-C still interrupts) for as long as the block runs, and put back
    as it was on every way out, SIGTERM and SIGHUP included (turned into KeyboardInterrupt)."""
    fd = _tty_fd(stream)
    if fd is None or termios is None:
        yield _wait
        return
    saved = termios.tcgetattr(fd)
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                break
            pressed = os.read(fd, 64).decode(errors="replace")
            if not pressed:  # the terminal closed
                return True
            if QUIT_KEYS & set(pressed):
                return True
        return False

    try:
        for sig in previous:
            signal.signal(sig, interrupt)
        tty.setcbreak(fd)
        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _tty_fd(stream: TextIO) -> int | None:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test, or closed
        return None
    return fd if os.isatty(fd) else None
