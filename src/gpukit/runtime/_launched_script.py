"""Runs a user's script in each process of ``gpukit launch`` and records how it failed.

torchrun runs this file, not the script, in every process. The script still runs as
``python script.py`` would run it: ``__name__ == "__main__"``, ``sys.argv[0]`` is its path and
its folder comes first on ``sys.path``. When it raises, the error goes to torchrun's
per-process error file (``TORCHELASTIC_ERROR_FILE``) with a nanosecond clock: torchrun's own
timestamps are whole seconds, too coarse to tell the process that failed from the ones that
failed a few milliseconds later because it had gone. The traceback printed is the script's
own, without this file's frames.

This file is run by path, not imported as ``gpukit._launched_script``: importing the package
would import torch before the script has had a chance to set its environment.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback
from types import TracebackType


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            record(stop)
        raise
    except Exception as err:  # KeyboardInterrupt and the like end the process as usual
        record(err)
        # The hook prints the traceback the error carries, so trim it there.
        err = err.with_traceback(scripts_frames(err.__traceback__, script))
        sys.excepthook(type(err), err, err.__traceback__)
        sys.exit(1)


def record(err: BaseException) -> None:
    """Write ``err`` to torchrun's error file, in torchrun's format plus ``time_ns``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(err)),
                "timestamp": str(int(time.time())),
                "time_ns": str(time.time_ns()),
            },
        }
    }
    try:
        with open(path, "w") as file:
            json.dump(data, file)
    except OSError:
        pass  # the script's own error matters more than our record of it


def scripts_frames(tb: TracebackType | None, script: str) -> TracebackType | None:
    """The traceback from the script's first frame on (None when it never ran: a SyntaxError)."""
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
