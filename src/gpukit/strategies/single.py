"""One process, one device: the plain training loop."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies.base import Strategy
from gpukit.strategies.float8 import check_float8_recipe
from gpukit.strategies.traits import Traits


class SingleDevice(Strategy):
    """Train on exactly one device; every hook is the base class's plain behaviour.
    ``float8``: None, or a torchao recipe ("tensorwise", "rowwise") the Linear layers
    compute in (see ``gpukit.strategies.float8``).

    >>> import gpukit as gk
    >>> rt = gk.Runtime(strategy="single", devices="cpu")
    >>> rt.world_size
    1
    """

    name: ClassVar[str] = "single"
    # Everything on the one device, nothing communicated.
    traits: ClassVar[Traits] = Traits(max_devices=1)

    def __init__(self, *, float8: str | None = None) -> None:
        super().__init__()
        self.float8 = check_float8_recipe(float8, "SingleDevice")

    def configure(self, devices: list[Device]) -> None:
        if len(devices) != 1:
            raise ConfigError(
                f"strategy {self.name!r} trains on one device, but {len(devices)} were given "
                f"({', '.join(map(str, devices))}): use strategy='ddp' (or 'auto') for several"
            )
        super().configure(devices)

    def setup_module(self, module: nn.Module) -> nn.Module:
        return super().setup_module(module)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module
