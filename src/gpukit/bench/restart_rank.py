"""One rank of ``gpukit bench restarts``: ``gpukit train`` as gpukit's launcher runs it, with
the moments of its start-up written to the job's folder (``marks-<rank>-<attempt>.json``).

Run by path through the launcher's runner (``python _launched_script.py restart_rank.py train
...``): its first line runs before torch or gpukit is imported, so both imports are timed.
The marks, ``time.time()`` seconds: ``script`` (this file's first line: the interpreter and
the runner are up), ``torch`` (``import torch`` done), ``gpukit`` (``import gpukit`` and its
command line done), ``start`` (the Runtime exists: its first heartbeat), ``joined`` (the
process group is joined), ``setup`` (``rt.setup`` begins: model, data and optimizer built),
``step`` (the attempt's first step is done: its first ``loop`` beat).

The marks come from wrapping ``Heartbeat.beat`` and ``init_process_group`` in this process
only, which costs a dictionary write per beat; the beats' ``where`` (the caller's line) is
empty here, as the wrapper is the caller they see.
"""

import time

_SCRIPT = time.time()

import importlib  # noqa: E402 (after the first mark, on purpose)
import json  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

MARKS = ("script", "torch", "gpukit", "start", "joined", "setup", "step")


def _write(marks: dict[str, float]) -> None:
    folder = os.environ.get("GPUKIT_JOB_DIR")
    if not folder:
        return
    from gpukit._util.files import write_atomic  # imported by then: the marks come after it

    rank, attempt = os.environ.get("RANK", "0"), os.environ.get("GPUKIT_ATTEMPT", "0")
    # Whole or not at all (the bench reads it once the step is done); a refusal names the file.
    path = os.path.join(folder, f"marks-{rank}-{attempt}.json")
    write_atomic(path, json.dumps(marks), option="TMPDIR=a writable folder")


def main() -> None:
    marks = {"script": _SCRIPT}
    sys.path[0] = os.getcwd()  # as `python -m gpukit` has it (not this file's folder)
    import torch  # noqa: F401

    marks["torch"] = time.time()
    import torch.distributed as dist

    import gpukit  # noqa: F401
    from gpukit.launch.heartbeat import Heartbeat

    importlib.import_module("gpukit.cli.__main__")  # the command line, as `-m gpukit` has it
    marks["gpukit"] = time.time()
    beat = Heartbeat.beat
    join = dist.init_process_group

    def marked_beat(self: Heartbeat, phase: str, step: int) -> None:
        now = time.time()
        if phase in ("start", "setup"):
            marks.setdefault(phase, now)
        elif phase == "loop" and "step" not in marks:
            marks["step"] = now
            _write(marks)
        beat(self, phase, step)

    def marked_join(*args: Any, **kwargs: Any) -> None:
        join(*args, **kwargs)
        marks.setdefault("joined", time.time())

    Heartbeat.beat = marked_beat  # type: ignore[method-assign]
    dist.init_process_group = marked_join
    sys.argv[0] = "gpukit"
    runpy.run_module("gpukit", run_name="__main__", alter_sys=True)  # `python -m gpukit ...`


if __name__ == "__main__":
    main()
