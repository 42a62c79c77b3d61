"""What a Runtime was asked for: its settings, frozen and checked once, and the devices they
name.

>>> RuntimeConfig(accumulate=2).accumulate
2
>>> RuntimeConfig(oom="sometimes")
Traceback (most recent call last):
...
gpukit.errors.ConfigError: oom='sometimes': use 'raise' (explain and stop), 'recover' ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from gpukit import _env
from gpukit.devices import Device
from gpukit.devices import device as resolve_device
from gpukit.devices import devices as list_devices
from gpukit.errors import ConfigError
from gpukit.strategies import Strategy

DevicesSpec = Any  # "auto" | "all" | int | str | Sequence[str | int | Device]
OomPolicy = Literal["raise", "recover", "auto"]


@dataclass(frozen=True)
class RuntimeConfig:
    """The settings of a :class:`~gpukit.Runtime` (see its docstring for each one)."""

    strategy: str | Strategy = "auto"
    precision: str = "auto"
    devices: DevicesSpec = "auto"
    accumulate: int = 1
    clip: float | None = None
    seed: int | None = None
    log_every: int = 50
    oom: OomPolicy = "raise"

    def __post_init__(self) -> None:
        _check_positive_int("accumulate", self.accumulate)
        _check_positive_int("log_every", self.log_every)
        if self.oom not in get_args(OomPolicy):
            raise ConfigError(
                f"oom={self.oom!r}: use 'raise' (explain and stop), 'recover' (re-split the "
                "batch and redo the step) or 'auto' (recover where it costs nothing per step: "
                "one process; raise under several)"
            )
        if self.clip is not None and not self.clip > 0:
            raise ConfigError(f"clip={self.clip!r}: give a positive max gradient norm, or None")

    def recovers(self, distributed: bool) -> bool:
        """Whether out-of-memory errors are recovered for a run that is ``distributed`` or not:
        "auto" recovers only where it costs nothing per step (one process)."""
        return self.oom == "recover" or (self.oom == "auto" and not distributed)


def resolve_devices(spec: DevicesSpec, launched: bool = False) -> list[Device]:
    """The devices a ``devices=`` argument asks for (duplicates allowed: CPU processes).

    Under a launcher "auto" means one device per local process: the GPU of the local rank
    when there are enough GPUs, else the CPU.
    """
    gpus = [d for d in list_devices() if d.type == "cuda"]
    if isinstance(spec, bool):
        raise ConfigError(f"devices={spec!r}: use 'auto', 'all', a count, or a list of devices")
    if isinstance(spec, int):
        if spec < 1:
            raise ConfigError(f"devices={spec}: give at least 1")
        if not gpus:
            return [resolve_device("cpu")] * spec
        if spec > len(gpus):
            raise ConfigError(
                f"devices={spec}, but this machine has {len(gpus)} GPU(s) "
                f"({', '.join(map(str, gpus))}): use devices={len(gpus)} or fewer"
            )
        return gpus[:spec]
    if spec == "auto":
        if launched:
            env = _env.launched()
            local = env.local_world_size if env else 1
            return gpus[:local] if len(gpus) >= local else [resolve_device("cpu")] * local
        return [resolve_device()]
    if spec == "all":
        return gpus or [resolve_device("cpu")]
    if isinstance(spec, str) and "," in spec:
        spec = [s.strip() for s in spec.split(",")]
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        return [resolve_device(spec)]
    if not spec:
        raise ConfigError("devices=[]: give at least one device")
    return [resolve_device(s) for s in spec]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
