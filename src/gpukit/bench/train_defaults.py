"""The Runtime settings of ``gpukit train`` run without options, for the benchmarks that time
"the loop as ``gpukit train`` runs it".

They are read from the command line's own argument parser, the one place they are defined, so
that a benchmark follows the command line when one of its defaults (``--oom``, ``--log-every``,
``--seed``, ...) changes, instead of keeping a copy that drifts.

>>> settings = runtime_settings(devices="cpu")
>>> settings["devices"], settings["seed"], settings["log_every"]
('cpu', 0, 10)
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from gpukit.runtime.runtime import Runtime


def runtime_settings(devices: Any = None) -> dict[str, Any]:
    """The keyword arguments ``gpukit train`` gives ``Runtime`` when given no option; with
    ``devices``, that one replaced (a benchmark that must stay on the CPU).

    >>> runtime_settings()["oom"] in ("raise", "recover", "auto")
    True
    """
    from gpukit.cli import train  # late: the command line imports the benchmarks, not back

    parser = argparse.ArgumentParser()
    train.register(parser.add_subparsers())
    given = vars(parser.parse_args([train.NAME]))
    # `gpukit train` hands Runtime exactly its options named like Runtime's parameters (the
    # others go to the training loop: workload, epochs, lr, ...).
    parameters = inspect.signature(Runtime).parameters
    settings = {name: value for name, value in given.items() if name in parameters}
    if devices is not None:
        settings["devices"] = devices
    return settings
