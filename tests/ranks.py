"""``fn(rank, *args)`` on several processes, as ``torch.multiprocessing.start_processes`` with
the "spawn" method runs it, for tests' plain reference programs and per-rank checks.

With the warm start on (tests/conftest.py), each rank is forked from the test worker's
warm-start server (``gpukit.launch.warm``), which has imported torch, instead of a fresh
interpreter that imports it again (seconds of CPU per rank). The rank still gets what spawn
gives it: this process's ``sys.path``, ``fn`` by reference and its arguments pickled, its own
process and torch's default thread count. As with ``start_processes(join=True)``, the call
returns when every rank ended with 0; the first rank to fail ends the others, and the error
says which rank failed and how (its traceback is on stderr, as spawn's is).

The runner the server forks is this same file, run as ``__main__``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The exit code of a rank whose process group could not listen on its port: another process
# took the free port between its choice and the bind (errno EADDRINUSE); a caller may retry.
PORT_TAKEN = 98


class RankFailed(RuntimeError):
    """A rank ended with another code than 0 (negative: the signal that ended it)."""

    def __init__(self, rank: int, exit_code: int) -> None:
        how = f"signal {-exit_code}" if exit_code < 0 else f"exit code {exit_code}"
        super().__init__(f"rank {rank} ended with {how} (its traceback is on stderr above)")
        self.rank = rank
        self.exit_code = exit_code


def start_processes(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` for every rank below ``nprocs`` and wait for them all."""
    server = os.environ.get("GPUKIT_WARM_START")
    if not server:
        import torch.multiprocessing as mp

        try:
            mp.start_processes(_call, args=(fn, args), nprocs=nprocs, start_method="spawn")
        except mp.ProcessExitedException as err:
            raise RankFailed(err.error_index, err.exit_code) from err
        return
    from gpukit.launch import warm_client

    with tempfile.TemporaryDirectory(prefix="gpukit-ranks-") as folder:
        call = Path(folder, "call.pkl")
        with call.open("wb") as file:
            pickle.dump(sys.path, file)  # first: the child needs it to import fn's module
            pickle.dump((fn, args), file)
        env = dict(os.environ)
        ranks = [
            warm_client.start_rank(server, [str(call), str(rank)], env, runner=Path(__file__))
            for rank in range(nprocs)
        ]
        try:
            while True:
                codes = [rank.poll() for rank in ranks]
                failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    raise RankFailed(*failed[0])
                if all(c == 0 for c in codes):
                    return
                time.sleep(0.02)
        finally:
            for rank in ranks:
                if rank.poll() is None:  # each leads its own process group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(rank.pid, signal.SIGKILL)
                    rank.wait()


def _call(rank: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        fn(rank, *args)
    except Exception as err:
        if "EADDRINUSE" not in str(err):
            raise
        import traceback

        traceback.print_exc()
        sys.exit(PORT_TAKEN)


def _run(call: str, rank: int) -> None:
    with open(call, "rb") as file:
        sys.path[:] = pickle.load(file)
        fn, args = pickle.load(file)
    _call(rank, fn, args)


if __name__ == "__main__":
    _run(sys.argv[1], int(sys.argv[2]))
