"""The Runtime settings of ``gpukit train`` run without options, for the benchmarks that time
"the loop as ``gpukit train`` runs it".

They are read from the settings' declarations (``gpukit.runtime.settings``), where the command
line takes its defaults from too, so that a benchmark follows the command line when one of them
(``--oom``, ``--log-every``, ``--seed``, ...) changes, instead of keeping a copy.

>>> settings = runtime_settings(devices="cpu")
>>> settings["devices"], settings["seed"], settings["log_every"]
('cpu', 0, 10)
"""

from __future__ import annotations

from typing import Any

from gpukit.runtime.settings import train_defaults


def runtime_settings(devices: Any = None) -> dict[str, Any]:
    """The keyword arguments ``gpukit train`` gives ``Runtime`` when given no option; with
    ``devices``, that one replaced (a benchmark that must stay on the CPU).

    >>> runtime_settings()["oom"] in ("raise", "recover", "auto")
    True
    """
    settings = train_defaults()
    if devices is not None:
        settings["devices"] = devices
    return settings
