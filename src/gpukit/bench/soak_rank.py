"""One rank of ``gpukit bench restarts --soak``: ``gpukit train`` as gpukit's launcher runs it,
with its process id written to the job's folder (``pid-<rank>-<attempt>``) on its first line,
before torch or gpukit is imported, so that the soak can kill it at any moment of its start-up
from outside.

Run by path through the launcher's runner (``python _launched_script.py soak_rank.py train
...``).
"""

import os
import runpy
import sys


def main() -> None:
    folder = os.environ.get("GPUKIT_JOB_DIR")
    if folder:
        rank, attempt = os.environ.get("RANK", "0"), os.environ.get("GPUKIT_ATTEMPT", "0")
        path = os.path.join(folder, f"pid-{rank}-{attempt}")
        with open(path + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.replace(path + ".tmp", path)  # whole: the soak never reads half a number
    sys.path[0] = os.getcwd()  # as `python -m gpukit` has it (not this file's folder)
    sys.argv[0] = "gpukit"
    runpy.run_module("gpukit", run_name="__main__", alter_sys=True)  # `python -m gpukit ...`


if __name__ == "__main__":
    main()
