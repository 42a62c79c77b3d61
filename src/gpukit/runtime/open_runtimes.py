"""The Runtimes this process set up and has not torn down, for the launcher's runner to close.

A Runtime joins :data:`OPEN` when it joins its process group and leaves it at
``rt.teardown()``; only a weak reference is kept, so a Runtime the program dropped is not kept
alive here.

>>> import gpukit as gk
>>> rt = gk.Runtime(devices="cpu")
>>> rt.barrier()  # the Runtime is ready: open
>>> rt in OPEN
True
>>> rt.teardown()
>>> rt in OPEN
False
"""

from __future__ import annotations

import weakref
from typing import Protocol


class Closable(Protocol):
    """What is torn down: a Runtime."""

    def teardown(self) -> None: ...


OPEN: weakref.WeakSet[Closable] = weakref.WeakSet()


def teardown_open_runtimes() -> int:
    """Tear down every Runtime this process set up and left open; how many there were. A
    script run by gpukit's launcher often ends without ``rt.teardown()``: the runner calls this
    when the script returns, so the ranks leave their process group in order (the models'
    reducers first) before the interpreter shuts down, where gloo's threads would abort it."""
    left = list(OPEN)
    for rt in left:
        rt.teardown()
    return len(left)
