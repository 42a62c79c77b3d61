"""A module that says when its objects are released (where ``RELEASED_PROBE`` is set): a
warm-start server of the tests imports it before its first fork, so a warm rank that ended would
say so only if it released the server's modules."""

import os


class _SaysWhenReleased:
    def __del__(self) -> None:
        if os.environ.get("RELEASED_PROBE"):
            os.write(1, b"a module the server imported was released\n")


_said_when_released = _SaysWhenReleased()
