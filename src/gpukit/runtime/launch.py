"""Starting processes: ``rt.launch`` on this machine, ``gpukit launch`` through torchrun.

``spawn`` starts one process per rank with the environment torchrun would give them
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT on a free port of
127.0.0.1). When a rank fails, the others are stopped and its error and traceback are raised
here as a :class:`LaunchError`: no rank is left waiting in a collective.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from gpukit import errors
from gpukit.errors import ConfigError, GpukitError, LaunchError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port(host: str, port: int) -> None:
    """Raise ConfigError when ``port`` on ``host`` is taken (a rendezvous would hang or fail)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(
                f"port {port} on {host} is already in use ({err.strerror}): pick another "
                "with --master-port, or leave it out to get a free one"
            ) from None


def spawn(
    make_runtime: Callable[[], Any],
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> Any:
    """Run ``fn(make_runtime(), *args)`` in ``world_size`` new processes; rank 0's result.

    ``make_runtime`` (picklable: ``functools.partial(Runtime, ...)``, say) is called inside
    each process, once the launch environment is in place, so it sees its rank."""
    port = free_port()
    # Results and errors travel as files: a pipe would block a rank writing more than its
    # buffer holds while this process waits for the ranks to exit.
    with tempfile.TemporaryDirectory(prefix="gpukit-launch-") as folder:
        outbox = Path(folder)
        try:
            mp.start_processes(
                _worker,
                args=(make_runtime, world_size, port, fn, args, str(outbox)),
                nprocs=world_size,
                start_method="spawn",
                join=True,
            )
        except mp.ProcessRaisedException as err:
            reported = outbox / f"error-{err.error_index}.pkl"
            if reported.exists():  # a GpukitError: the rank's own one-line message is the news
                cls_name, message = pickle.loads(reported.read_bytes())
                cls = getattr(errors, cls_name, GpukitError)
                raise cls(f"rank {err.error_index}: {message}") from None
            raise LaunchError(f"rank {err.error_index} failed:\n{err}".rstrip()) from None
        except mp.ProcessExitedException as err:
            raise LaunchError(
                f"rank {err.error_index} exited with code {err.exit_code} before finishing "
                "(killed, out of memory, or os._exit)"
            ) from None
        result = outbox / "result.pkl"
        return pickle.loads(result.read_bytes()) if result.exists() else None


def _worker(
    local_rank: int,
    make_runtime: Callable[[], Any],
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    outbox: str,
) -> None:
    os.environ.update(
        {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    try:
        runtime = make_runtime()
        try:
            result = fn(runtime, *args)
        finally:
            runtime.teardown()
    except GpukitError as err:
        error = pickle.dumps((type(err).__name__, str(err)))
        (Path(outbox) / f"error-{local_rank}.pkl").write_bytes(error)
        raise
    if runtime.is_global_zero:
        # Plain pickle copies tensors by value (torch's own pickling would share memory with
        # a process that is about to exit).
        (Path(outbox) / "result.pkl").write_bytes(pickle.dumps(result))
