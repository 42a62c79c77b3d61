"""``python -m gpukit ...`` for tests, forked from the warm-start server instead of started cold.

A test that runs the command line starts ``[sys.executable, "-m", "gpukit", ...]``; with the
warm start on (tests/conftest.py) that command becomes ``[sys.executable, THIS_FILE, SOCKET,
...]``: a client that imports neither torch nor gpukit (milliseconds), asks the test worker's
warm-start server (``gpukit.launch.warm``) to fork ``python -m gpukit ...`` with the client's
environment, working folder and standard streams, and then stands for it:

- signals sent to the client (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are passed
  on to the command;
- the client ends as the command ended: the same exit code, or killed by the same signal;
- a client killed outright (SIGKILL) closes its connection, and the server kills the
  command's process group, as the kernel would have killed a cold command's ranks.

What differs from a cold start is the warm start's own (see ``gpukit.launch.warm``): the
command's pid is not the client's, its parent is the server, and what Python and torch read
at start comes from the server. Tests that look at those are marked ``cold_start``.

A test may ask for a script of its own to be forked the same way (``script_command``:
``python SCRIPT ...`` becomes ``[sys.executable, THIS_FILE, SOCKET, --as-script, SCRIPT,
...]``); other commands start cold.

The server runs this same file as the runner of the forked command (``--as-gpukit``,
``--as-script``).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import socket
import sys

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
AS_GPUKIT = "--as-gpukit"
AS_SCRIPT = "--as-script"


def command(argv: list[str], socket_path: str) -> list[str] | None:
    """The client's command line for ``argv`` when it is ``python -m gpukit ...`` with this
    interpreter; None for any other command."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1:3] == ["-m", "gpukit"]:
        return [sys.executable, os.path.abspath(__file__), socket_path, *argv[3:]]
    return None


def script_command(argv: list[str], socket_path: str) -> list[str]:
    """The client's command line for ``argv``, ``[sys.executable, SCRIPT, *args]``: the script
    forked warm as ``python -m gpukit`` is. Only for a test that asks for it, whose script's
    process need not be the one the test started (signals reach it through the client)."""
    assert argv[0] == sys.executable, argv
    return [sys.executable, os.path.abspath(__file__), socket_path, AS_SCRIPT, *argv[1:]]


def _client(socket_path: str, args: list[str]) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(socket_path)
    request = {
        "runner": os.path.abspath(__file__),
        "args": args if args[:1] == [AS_SCRIPT] else [AS_GPUKIT, *args],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
    }
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    kind, _, value = conn.recv(64).decode().partition(" ")
    if kind != "pid":
        sys.exit(f"warm_gpukit: the warm-start server did not start the command ({kind} {value})")
    pid = int(value)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    while True:
        try:
            data = conn.recv(64)
            break
        except InterruptedError:
            continue
    kind, _, value = data.decode().partition(" ")
    code = int(value) if kind == "exit" else -signal.SIGKILL
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _as_gpukit(args: list[str]) -> None:
    """In the forked command: what ``python -m gpukit args`` sets before running gpukit."""
    sys.path[0] = os.getcwd()
    sys.argv = ["-m", *args]  # runpy puts the module's path in sys.argv[0]
    runpy.run_module("gpukit", run_name="__main__", alter_sys=True)


def _as_script(args: list[str]) -> None:
    """In the forked command: what ``python SCRIPT *args`` sets before running the script."""
    sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
    sys.argv = list(args)
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1] == AS_GPUKIT:
        _as_gpukit(sys.argv[2:])
    elif sys.argv[1] == AS_SCRIPT:
        _as_script(sys.argv[2:])
    else:
        _client(sys.argv[1], sys.argv[2:])
