"""What a ``dp-balanced`` forward returns: each device's outputs, left where they were computed.

>>> import torch
>>> cpu = torch.device("cpu")
>>> out = PerDevice((torch.zeros(2, 1), torch.ones(1, 1)), (cpu, cpu), (2, 1))
>>> out.gather().flatten().tolist()
[0.0, 0.0, 1.0]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from gpukit.devices import DeviceSpec
from gpukit.devices import device as resolve_device
from gpukit.strategies._parallel import gather

Reduction = Literal["mean", "sum"]


@dataclass(frozen=True)
class PerDevice:
    """Outputs of a ``dp-balanced`` forward, left on the devices that computed them.

    ``outputs[i]`` came from the ``sizes[i]`` samples sent to ``devices[i]``. Give it to the
    criterion from ``rt.setup_criterion``; call :meth:`gather` where the whole output is
    needed on one device (an accuracy, say).
    """

    outputs: tuple[Any, ...]
    devices: tuple[torch.device, ...]
    sizes: tuple[int, ...]

    def gather(self, device: DeviceSpec | None = None) -> Any:
        """The outputs joined along the batch dimension on ``device`` (default: the first)."""
        target = resolve_device(device).torch if device is not None else self.devices[0]
        return gather(self.outputs, target)
