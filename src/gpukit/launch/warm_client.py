"""The launcher's side of the warm start (``gpukit.launch.warm``): ranks forked by the server.

``start_worker`` starts a rank here when ``GPUKIT_WARM_START`` names a server's socket (or the
job keeps a server of its own for its restarts, ``gpukit.launch.warm_restarts``) and the
command runs gpukit's runner with this interpreter (``python RUNNER ...``: every rank of
``gpukit launch``, ``gpukit train --devices N`` and ``rt.launch``); any other command starts
cold, as the server runs only the runner. A server that does not answer is an error, never a
quiet cold start: the user asked for the warm one.

A rank's connection stays open while it runs: closing it (this process ending, even by SIGKILL)
makes the server SIGKILL the rank's group, so ranks die with their launcher as cold ones do.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from gpukit.errors import LaunchError

# One request is one packet: the JSON below, with the three descriptors attached.
MAX_REQUEST = 1024 * 1024
# Replies, each a packet: the child's pid once it leads its group, then its exit status.
PID, EXIT = "pid", "exit"


def reply(kind: str, value: int) -> bytes:
    """A reply packet: ``b"pid 1234"``, ``b"exit -9"``."""
    return f"{kind} {value}".encode()


@dataclass(frozen=True)
class Request:
    """A rank to start: ``python RUNNER *args`` with exactly ``env``, in ``cwd``."""

    runner: str
    args: list[str]
    env: dict[str, str]
    cwd: str

    def encode(self) -> bytes:
        return json.dumps(
            {"runner": self.runner, "args": self.args, "env": self.env, "cwd": self.cwd}
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        fields = json.loads(data)
        return cls(str(fields["runner"]), list(fields["args"]), dict(fields["env"]), fields["cwd"])


_RUNNER = Path(__file__).resolve().parent / "_launched_script.py"
# How long the server may take to fork a rank and tell its pid (it does so in milliseconds; a
# machine swapping hard is the only slow case).
REPLY_TIMEOUT_S = 120.0


def runner_args(command: list[str]) -> list[str] | None:
    """The arguments after the runner when ``command`` is ``python RUNNER ...`` with this
    interpreter; None for any other command.

    >>> runner_args([sys.executable, str(_RUNNER), "train.py", "--epochs", "3"])
    ['train.py', '--epochs', '3']
    >>> runner_args([sys.executable, "-c", "pass"]) is None
    True
    """
    if len(command) < 2 or not _same_file(command[0], sys.executable):
        return None
    return command[2:] if _same_file(command[1], str(_RUNNER)) else None


def _same_file(a: str, b: str) -> bool:
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:
        return False


class WarmProcess:
    """A rank forked by the warm-start server: what ``workers.Process`` asks of a process,
    with ``returncode`` as ``subprocess.Popen`` reports it (negative: the signal that ended
    it), read from the connection that started it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._lock = threading.Lock()

    def wait(self) -> int:
        while True:
            code = self.poll()
            if code is not None:
                return code
            # Outside the lock, so poll() answers at once meanwhile; a poll that read the
            # status closes the socket, which ends this select too.
            with contextlib.suppress(OSError, ValueError):
                select.select([self._conn], [], [])

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                with contextlib.suppress(BlockingIOError):
                    self._ended(self._conn.recv(64, socket.MSG_DONTWAIT))
            return self.returncode

    def _ended(self, data: bytes) -> None:
        kind, _, value = data.decode(errors="replace").partition(" ")
        # No status: the server died, and its ranks with it (PR_SET_PDEATHSIG's SIGKILL).
        self.returncode = int(value) if kind == EXIT else -9
        self._conn.close()


def start_rank(
    path: str, args: list[str], env: Mapping[str, str], runner: Path = _RUNNER
) -> WarmProcess:
    """Ask the server at ``path`` for a rank running ``runner *args`` with exactly ``env``,
    in this process's working folder and with its stdin, stdout and stderr (``runner``:
    gpukit's own, ``_launched_script.py``, unless another is named)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError as err:
        conn.close()
        raise LaunchError(
            f"GPUKIT_WARM_START={path}: no warm-start server answers there ({err.strerror}); "
            f"start one with `{sys.executable} -m gpukit.launch.warm {path}`, or unset "
            "GPUKIT_WARM_START to start each rank as a fresh interpreter"
        ) from None
    # The rank's parent will be the server: it is told which process stands for its parent.
    env = {**env, "GPUKIT_WARM_PARENT": str(os.getpid())}
    request = Request(str(runner), list(args), env, os.getcwd())
    with _stdio() as fds:
        try:
            conn.settimeout(REPLY_TIMEOUT_S)
            socket.send_fds(conn, [request.encode()], fds)
            data = conn.recv(64)
        except OSError as err:
            conn.close()
            raise LaunchError(
                f"GPUKIT_WARM_START={path}: the warm-start server did not start the rank "
                f"({err}); unset GPUKIT_WARM_START to start ranks cold"
            ) from None
    # The reply timeout was for the start alone: the exit status comes when the rank ends,
    # hours later perhaps, and WarmProcess waits for it without a limit.
    conn.settimeout(None)
    kind, _, value = data.decode(errors="replace").partition(" ")
    if kind != PID:
        conn.close()
        why = f"it ended before the runner started (exit {value})" if kind == EXIT else "no pid"
        raise LaunchError(
            f"GPUKIT_WARM_START={path}: the warm-start server did not start the rank ({why}: "
            "see its error above); unset GPUKIT_WARM_START to start ranks cold"
        )
    return WarmProcess(conn, int(value))


@contextlib.contextmanager
def _stdio() -> Iterator[list[int]]:
    """This process's descriptors 0-2 for the rank (``/dev/null`` for one that is closed)."""
    opened: list[int] = []
    fds = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
            fds.append(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            opened.append(null)
            fds.append(null)
    try:
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


def start_server(
    path: str | Path, preload: tuple[str, ...] = (), timeout: float = 120.0
) -> subprocess.Popen[bytes]:
    """Start a warm-start server at ``path`` (it dies with this process), once it answers;
    it imports the modules in ``preload`` as well as torch and gpukit."""
    return wait_for_server(spawn_server(path, preload), path, timeout)


def spawn_server(
    path: str | Path, preload: tuple[str, ...] = (), env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a warm-start server at ``path`` without waiting for it: it imports torch, gpukit
    and ``preload`` (seconds) while the caller does something else, then
    :func:`wait_for_server`. ``env``: its environment (default this process's), which is what
    its ranks' Python and torch read at start."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpukit.launch.warm", str(path), *preload],
        stdin=subprocess.DEVNULL,
        env=None if env is None else dict(env),
    )


def wait_for_server(
    server: subprocess.Popen[bytes], path: str | Path, timeout: float = 120.0
) -> subprocess.Popen[bytes]:
    """``server`` once it answers at ``path``; killed, and a LaunchError, if it ends or does
    not answer within ``timeout`` seconds."""
    path = str(path)
    deadline = time.monotonic() + timeout
    while server.poll() is None and time.monotonic() < deadline:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
            return server
        except OSError:
            time.sleep(0.05)
        finally:
            probe.close()
    server.kill()
    server.wait()
    raise LaunchError(f"the warm-start server at {path} did not start (exit {server.returncode})")
