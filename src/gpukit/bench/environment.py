"""Where a benchmark ran: date, command, versions, processor and device, as one JSON-ready dict.

Every benchmark stores this beside its numbers, so that a result file says by itself what
produced it and on which machine.

>>> env = environment(threads=1)
>>> env["device"], env["threads"], env["torch"] == torch.__version__
('cpu', 1, True)
"""

from __future__ import annotations

import platform
import shlex
import sys
from datetime import datetime, timezone
from typing import Any

import torch

from gpukit import __version__
from gpukit.devices import hw as _hw


def environment(
    device: str = "cpu", threads: int | None = None, command: str | None = None
) -> dict[str, Any]:
    """The facts a benchmark result must carry to be comparable with another.

    Args:
        device: the torch device the benchmark measured, e.g. "cpu" or "cuda:0".
        threads: the torch intra-op threads the measurement used (default: the current setting).
        command: the command that produced the result (default: this process's exact command
            line, interpreter included).

    >>> sorted(environment())[:4]
    ['command', 'cpu', 'cpu_cores', 'cuda']
    """
    dev = torch.device(device)
    _, usable_cores = _hw.cpu_cores()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        # sys.orig_argv keeps the interpreter and its flags (`python -m gpukit ...`, `-c ...`),
        # which sys.argv drops.
        "command": command if command is not None else shlex.join(sys.orig_argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_build": _hw.torch_build(),
        "cuda": torch.version.cuda,
        "gpukit": __version__,
        "os": platform.platform(),
        "cpu": _hw.cpu_name(),
        "cpu_cores": usable_cores,
        "threads": torch.get_num_threads() if threads is None else threads,
        "device": str(dev),
        "device_name": _device_name(dev),
    }


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else _hw.cuda_current()
        try:
            return _hw.cuda_properties(index).name
        except Exception as err:  # a broken GPU must not cost the numbers already measured
            return f"cuda:{index} (unreadable: {err})"
    if dev.type == "cpu":
        return _hw.cpu_name()
    return dev.type


def environment_of(devices: list[torch.device], command: str | None = None) -> dict[str, Any]:
    """:func:`environment` for an experiment that ran on several devices: the first one's
    facts, plus every device with its name under ``devices``.

    >>> environment_of([torch.device("cpu")])["devices"][0]["device"]
    'cpu'
    """
    env = environment(str(devices[0]) if devices else "cpu", command=command)
    env["devices"] = [{"device": str(d), "name": _device_name(d)} for d in devices]
    return env
