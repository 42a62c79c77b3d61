"""A warm start for ranks: one interpreter that has imported torch and gpukit forks each rank.

A rank started cold is a fresh interpreter that imports torch (seconds of CPU); started warm
it is a fork of this server, which has imported them once, and starts in milliseconds. The
launcher uses it when ``GPUKIT_WARM_START`` names the server's socket (``gpukit._env``):

    python -m gpukit.launch.warm /tmp/gpukit-warm.sock   # the server, for as long as it runs
    GPUKIT_WARM_START=/tmp/gpukit-warm.sock gpukit launch --nproc-per-node 2 train.py

Modules named after the socket are imported too, once, before the first fork (as
multiprocessing's ``set_forkserver_preload``): what every rank would import anyway, such as
``matplotlib.pyplot`` or a model library. They read their environment in the server.

The server is one thread with a ``select`` loop over a Unix socket (a thread beside it would
not survive the forks). A request (``gpukit.launch.warm_client``) carries the runner's
arguments, the rank's exact environment and working folder, and the launcher's stdin, stdout
and stderr as file descriptors. The child then becomes what ``python RUNNER args`` would have
been: a session (so a process group) of its own, default signal handlers, ``os.environ``
replaced, the working folder, the three descriptors, ``sys.argv`` and ``sys.path[0]`` as the
interpreter sets them; it runs the runner as ``__main__`` and ends the way an interpreter ends
(non-daemon threads joined, ``atexit`` handlers run, the exit code of ``SystemExit`` or 1 for an
uncaught error), less the release of the server's modules (``gpukit.launch.warm_exit``). The
child tells the launcher its pid once it leads its own group (the launcher may ``killpg`` it
from then on); the server reaps it and sends its exit status on the same connection. Workers
die with the launcher still: when a launcher's connection closes (its process ended, even by
SIGKILL) the server SIGKILLs that rank's process group; a rank dies with the server
(``PR_SET_PDEATHSIG``), and the server with the process that started it.

What a fork cannot give: what was decided when the server imported torch and Python started.
Variables read then come from the server's environment, not the rank's: Python's
(``PYTHONHASHSEED``: every warm rank hashes strings alike; ``PYTHONWARNINGS``,
``PYTHONDONTWRITEBYTECODE``, ``-X`` options) and those torch and its libraries read at import
(``TORCH_LOGS``, ``TORCHDYNAMO_*``, ``TORCHINDUCTOR_*``, ``MKL_*``, ``KMP_*``, ``GOMP_*``,
``OMP_*`` but ``OMP_NUM_THREADS``, which each rank applies with ``torch.set_num_threads``).
Modules the server imported (torch with its sharding and distributed checkpoint, gpukit) come
from the server's ``sys.path``; the rank's ``PYTHONPATH`` is put in front for the rest.
``PYTHONUNBUFFERED`` and ``PYTHONFAULTHANDLER`` are honoured, and Python's and NumPy's random
generators are seeded afresh. The objects the server made at import are frozen (``gc.freeze``):
a rank's collector leaves them alone and ``gc.get_objects()`` does not list them. CUDA reads
``CUDA_VISIBLE_DEVICES`` when it first starts, in the rank: the server never touches a GPU
(nor torch's CPU thread pool, which a fork would leave without its threads). A rank's parent
is the server, not the launcher; the rank's ``GPUKIT_WARM_PARENT`` names the launcher, which
the folder lock counts as its parent.

A job that may restart starts a server of its own for its restarts
(``gpukit.launch.warm_restarts``), with the job's environment: what Python and torch read at
start is then the rank's, and only the variables by which Python reports on its own start-up
still differ (with one of them set, that job restarts cold).
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import io
import locale
import os
import select
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from gpukit.launch import warm_exit
from gpukit.launch.warm_client import EXIT, MAX_REQUEST, PID, Request, reply


@dataclass
class _Child:
    """A forked rank and the connection of the launcher that asked for it (None once closed)."""

    pid: int
    conn: socket.socket | None


class Server:
    """Serves ``path`` until the process that started it dies; forks a rank per request."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pid = os.getpid()
        self.listener = listen(path)
        self.waiting: set[socket.socket] = set()  # connected, no request yet
        self.children: dict[int, _Child] = {}
        self.by_conn: dict[socket.socket, _Child] = {}
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        # A handler (not SIG_DFL, which drops SIGCHLD) so that the wakeup fd hears of each child.
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def serve(self) -> tuple[Request, list[int], socket.socket] | None:
        """Serve until stopped (None); in a forked child, return the child's request, the
        descriptors it brought and its connection."""
        while True:
            readable = self._select()
            for item in readable:
                if item is self.listener:
                    conn, _ = self.listener.accept()
                    self.waiting.add(conn)
                elif item == self.wake_r:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self.wake_r, 512):
                            pass
                    self._reap()
                elif isinstance(item, socket.socket) and item in self.waiting:
                    started = self._start(item)
                    if started is not None:
                        return started
                elif isinstance(item, socket.socket) and item in self.by_conn:
                    self._gone(item)

    def _select(self) -> list[socket.socket | int]:
        watched: list[socket.socket | int] = [
            self.listener,
            self.wake_r,
            *self.waiting,
            *self.by_conn,
        ]
        try:
            readable, _, _ = select.select(watched, [], [])
        except InterruptedError:  # pragma: no cover (PEP 475 retries)
            return []
        return readable

    def _start(self, conn: socket.socket) -> tuple[Request, list[int], socket.socket] | None:
        self.waiting.discard(conn)
        try:
            data, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
            request = Request.decode(data) if data and not flags & socket.MSG_TRUNC else None
        except (OSError, ValueError, KeyError, TypeError):
            request, fds = None, []
        if request is None or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            self._leave()
            return request, fds, conn
        for fd in fds:
            os.close(fd)
        child = _Child(pid, conn)
        self.children[pid] = child
        self.by_conn[conn] = child
        return None

    def _gone(self, conn: socket.socket) -> None:
        """The launcher closed its connection (it died, or was done): its rank goes too."""
        child = self.by_conn.pop(conn)
        child.conn = None
        conn.close()
        if child.pid in self.children:
            # Both: before its setsid the child leads no group yet.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None or child.conn is None:
                continue
            with contextlib.suppress(OSError):  # the launcher went in the meantime
                child.conn.send(reply(EXIT, os.waitstatus_to_exitcode(status)))
            self.by_conn.pop(child.conn, None)
            child.conn.close()

    def _leave(self) -> None:
        """In the forked child: let go of everything that is the server's."""
        signal.set_wakeup_fd(-1)
        self.listener.close()  # the path stays: only the server unlinks it
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        for conn in [*self.waiting, *self.by_conn]:
            conn.close()

    def close(self) -> None:
        if os.getpid() == self.pid:
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def listen(path: str) -> socket.socket:
    """A socket listening at ``path``; SystemExit when a server already answers there."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a socket left by a server that died
    else:
        sys.exit(f"gpukit.launch.warm: {path} is served already; give another path")
    finally:
        probe.close()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    return listener


def become_rank(request: Request, fds: list[int], conn: socket.socket, server: int) -> None:
    """In the forked child: become ``python RUNNER args`` as a cold start would have it, tell
    the launcher the pid, and hand over to the runner."""
    from gpukit.launch.workers import die_with

    os.setsid()
    die_with(server)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # What the rank's own interpreter would have read from its environment at start.
    old_pythonpath = _pythonpath(os.environ)
    os.environ.clear()
    os.environ.update(_coerce_locale(request.env))
    with contextlib.suppress(locale.Error):
        locale.setlocale(locale.LC_CTYPE, "")  # as the interpreter does at start
    os.chdir(request.cwd)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    _reopen_stdio(request.env)
    if request.env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.argv = [request.runner, *request.args]
    rest = [p for p in sys.path[1:] if p not in old_pythonpath]
    sys.path[:] = [os.path.dirname(request.runner), *_pythonpath(request.env), *rest]
    _fresh_state(request.env)
    conn.send(reply(PID, os.getpid()))  # it leads its own group: the launcher may kill it
    conn.close()


def _coerce_locale(env: dict[str, str]) -> dict[str, str]:
    """``env`` as a fresh interpreter leaves it: in the C locale, Python sets ``LC_CTYPE`` to
    a UTF-8 one (PEP 538) unless ``PYTHONCOERCECLOCALE=0`` or ``LC_ALL`` says otherwise."""
    ctype = env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "C"
    if env.get("LC_ALL") or ctype not in ("C", "POSIX") or env.get("PYTHONCOERCECLOCALE") == "0":
        return env
    return {**env, "LC_CTYPE": _UTF8_LOCALE}


def _pythonpath(env: os._Environ[str] | dict[str, str]) -> list[str]:
    value = env.get("PYTHONPATH", "")
    return [os.path.abspath(p) for p in value.split(os.pathsep) if p]


def _reopen_stdio(env: dict[str, str]) -> None:
    """New ``sys.std*`` on descriptors 0-2, buffered as a fresh interpreter buffers them."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    # Kept open for the life of the rank, as the interpreter's own streams are.
    stdin = open(0, "rb", closefd=False)  # noqa: SIM115
    sys.stdin = io.TextIOWrapper(stdin, encoding=encoding, errors=errors)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)  # noqa: SIM115
        stream = io.TextIOWrapper(
            raw,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else errors,
            line_buffering=fd == 2 or os.isatty(fd),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_state(env: dict[str, str]) -> None:
    """Seed what the fork copied (random's own fork hook reseeds it), size torch's CPU
    thread pool from the rank's ``OMP_NUM_THREADS``, which torch read at import, and forget
    the server's temporary folder, which ``tempfile`` keeps once asked: the rank's is found
    again from its own ``TMPDIR``."""
    tempfile.tempdir = None
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    elif torch is not None:
        torch.set_num_threads(_DEFAULT_THREADS)


# The locale a fresh interpreter coerces the C locale to (the first this machine has).
_UTF8_LOCALE = "C.UTF-8"
# torch's thread count without OMP_NUM_THREADS, for ranks whose environment has none.
_DEFAULT_THREADS = 1


def _utf8_locale() -> str:
    """The locale Python coerces the C locale to here: the first of PEP 538's that exists."""
    current = locale.setlocale(locale.LC_CTYPE)
    try:
        for name in ("C.UTF-8", "C.utf8", "UTF-8"):
            with contextlib.suppress(locale.Error):
                locale.setlocale(locale.LC_CTYPE, name)
                return name
        return "C.UTF-8"
    finally:
        locale.setlocale(locale.LC_CTYPE, current)


def main(argv: list[str]) -> None:
    global _DEFAULT_THREADS, _UTF8_LOCALE
    if not argv:
        sys.exit("usage: python -m gpukit.launch.warm SOCKET [MODULE ...]")
    from gpukit.launch.workers import die_with

    die_with(os.getppid())
    os.environ.pop("OMP_NUM_THREADS", None)
    # What ranks import: torch and gpukit (the package, which a submodule's import loads
    # first, and the launcher's modules; the command line a rank may run is a tenth of a
    # second more, and above this layer), torch's sharding and distributed checkpoint, and
    # torch._dynamo, which the first optimizer a rank makes imports (half a second of CPU).
    import torch
    import torch._dynamo
    import torch.distributed.checkpoint
    import torch.distributed.fsdp

    import gpukit.launch.functions  # noqa: F401

    for name in argv[1:]:
        try:
            importlib.import_module(name)
        except Exception as err:  # the server is of no use without what it was asked for
            sys.exit(f"gpukit.launch.warm: cannot preload {name}: {type(err).__name__}: {err}")
    # torch's pool is sized when first used: the server never uses it, so this reads the size.
    _DEFAULT_THREADS = torch.get_num_threads()
    _UTF8_LOCALE = _utf8_locale()
    # What was imported lives as long as any rank: out of the collector's sight, a rank's
    # collections (and the one at its exit) no longer write to every page the fork shares,
    # which made a warm rank's exit cost more CPU than a cold one's.
    gc.freeze()
    server = Server(argv[0])
    # Stopped on purpose, the server removes its socket (``finally`` below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        started = server.serve()
    finally:
        server.close()
    if started is not None:
        request, fds, conn = started
        become_rank(request, fds, conn, server.pid)
        warm_exit.run(request.runner)


if __name__ == "__main__":
    main(sys.argv[1:])
