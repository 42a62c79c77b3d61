"""DDP's own options, checked when the strategy is built: torch would only reject (or misuse)
them once the processes run."""

from __future__ import annotations

import datetime
import numbers

from gpukit._util.text import described
from gpukit.errors import ConfigError


def check_options(
    find_unused_parameters: object, static_graph: object, bucket_cap_mb: object, timeout: object
) -> None:
    """Refuse DDP options that torch would only reject (or misuse) once the processes run."""
    for name, flag in (
        ("find_unused_parameters", find_unused_parameters),
        ("static_graph", static_graph),
    ):
        if not isinstance(flag, bool):
            raise ConfigError(f"DDP({name}={described(flag)}): give True or False")
    if bucket_cap_mb is not None:
        number = isinstance(bucket_cap_mb, numbers.Real) and not isinstance(bucket_cap_mb, bool)
        # Compared, not converted: float() of a huge int raises. A bucket is at most a TiB
        # (2**20 MiB): more than any device holds, and far below what torch's int64 takes.
        if not (number and 0 < bucket_cap_mb <= 2**20):  # type: ignore[operator]
            raise ConfigError(
                f"DDP(bucket_cap_mb={described(bucket_cap_mb)}): give the size of a gradient "
                "bucket in MiB, a number above 0 and at most 1048576 (torch's default is 25), "
                "or None for torch's default"
            )
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ConfigError(
            f"DDP(timeout={described(timeout)}): give a positive datetime.timedelta, e.g. "
            "timeout=datetime.timedelta(minutes=10)"
        )
