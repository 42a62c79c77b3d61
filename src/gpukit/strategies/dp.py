"""Data parallelism in one process: ``dp`` (DataParallel's semantics) and ``dp-balanced``.

Every forward scatters the batch over the devices, replicates the model onto them and runs the
replicas in parallel threads. ``dp`` then gathers every output on one device, as
``torch.nn.DataParallel`` does, so the loss, the full outputs and their gradients all sit on
that device: it runs out of memory first. ``dp-balanced`` leaves each output where it was
computed (a :class:`PerDevice`); the criterion from ``rt.setup_criterion`` scatters the targets
the same way, computes the loss on every device, and only the per-device scalar losses travel.

>>> import torch, gpukit as gk
>>> rt = gk.Runtime(strategy="dp-balanced", devices=["cpu", "cpu"])
>>> model = rt.setup(torch.nn.Linear(3, 2))
>>> criterion = rt.setup_criterion(torch.nn.functional.cross_entropy)
>>> out = model(torch.randn(5, 3))
>>> out.sizes
(3, 2)
>>> criterion(out, torch.tensor([0, 1, 1, 0, 1])).shape
torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from gpukit._util import placement
from gpukit._util.batch import batch_size, chunk_sizes
from gpukit._util.text import described
from gpukit._util.wrapping import pickled_as_model
from gpukit.devices.device import Device, DeviceSpec
from gpukit.devices.device import device as resolve_device
from gpukit.devices.spec import SpecError, parse
from gpukit.errors import ConfigError
from gpukit.strategies._criterion import ParallelCriterion, reduction_of
from gpukit.strategies._parallel import gather, parallel_apply, replicate, scatter
from gpukit.strategies.base import MemoryAdvice, Recovery, Strategy, check_criterion
from gpukit.strategies.per_device import PerDevice
from gpukit.strategies.traits import Collective, Traits

# Every micro-step the first device broadcasts the weights to the replicas, reduces their
# gradients back, and sends out the inputs and takes in the outputs; nothing overlaps.
_DP_COLLECTIVES = (
    Collective("broadcast", "weights", per="micro-step"),
    Collective("reduce", "gradients", per="micro-step"),
    Collective("scatter-gather", "samples", per="micro-step"),
)


class DataParallelModule(nn.Module):
    """The user's model behind scatter -> replicate -> parallel apply -> gather (or not)."""

    def __init__(
        self,
        module: nn.Module,
        devices: list[torch.device],
        output_device: torch.device,
        gather_outputs: bool,
    ) -> None:
        super().__init__()
        self.module = module
        self.devices = devices
        self.output_device = output_device
        self.gather_outputs = gather_outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        n = batch_size((args, kwargs))
        if len(self.devices) == 1 or n is None:
            return self.module(*args, **kwargs)
        sizes = chunk_sizes(n, len(self.devices))
        devices = self.devices[: len(sizes)]  # a batch smaller than the devices uses fewer
        inputs = scatter(args, kwargs, sizes, devices)
        outputs = parallel_apply(replicate(self.module, devices), inputs, devices)
        if self.gather_outputs:
            return gather(outputs, self.output_device)
        return PerDevice(tuple(outputs), tuple(devices), tuple(sizes))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickled_as_model(self.module)  # the devices are this process's, not the model's


class DPRecovery(Recovery):
    """Out of memory under dp: the first device holds more than the others (see
    ``DP.memory_story``)."""

    strategy: DP

    def advice(self, peak: int | None, imbalance: float | None) -> MemoryAdvice | None:
        if imbalance is not None and imbalance <= 1.2:
            return None  # balanced enough: the imbalance is not what ran out
        title, why, fix, assumed, sure, unsure = self.strategy.memory_story
        ratio = imbalance if imbalance is not None else assumed
        said = f" (its peak is {ratio:.1f}x the least-loaded GPU's)" if imbalance else ""
        return MemoryAdvice(
            title,
            f"{why}{said}: {fix}",
            None if peak is None else int(peak * (1 - 1 / ratio)),
            sure if imbalance else unsure,
        )


class DP(Strategy):
    """One process drives every device; the master weights live on the first one.

    Args:
        output_device: where outputs are gathered (default: the first device). Moving it
            elsewhere only moves the memory peak there; ``dp-balanced`` removes it.

    >>> import gpukit as gk
    >>> rt = gk.Runtime(strategy="dp", devices=["cpu", "cpu", "cpu"])
    >>> rt.world_size, len(rt.strategy.devices)
    (1, 3)
    """

    name: ClassVar[str] = "dp"
    gather_outputs: ClassVar[bool] = True
    # One process over several devices (one device is plain single-device training).
    traits: ClassVar[Traits] = Traits(
        drives_all_devices=True, gathers_outputs=True, min_devices=2, collectives=_DP_COLLECTIVES
    )
    recovery_class: ClassVar[type[Recovery]] = DPRecovery

    def __init__(self, *, output_device: DeviceSpec | None = None) -> None:
        super().__init__()
        self.output_device_spec = _checked_member("output_device", output_device)

    def configure(self, devices: list[Device]) -> None:
        if placement.launched() is not None:
            raise ConfigError(
                f"strategy {self.name!r} drives all devices from one process, but this process "
                "is one rank of a launched job: use strategy='ddp' under gpukit launch, or run "
                "the script with plain python"
            )
        kinds = {d.type for d in devices}
        if len(kinds) > 1 or (kinds - {"cuda", "cpu"} and len(devices) > 1):
            raise ConfigError(
                f"strategy {self.name!r} needs devices of one kind (all CUDA GPUs, or CPUs for "
                f"testing), but got {', '.join(map(str, devices))}: e.g. devices='all' or "
                "devices=['cpu', 'cpu']"
            )
        gpus = [d for d in devices if d.type == "cuda"]
        if len(set(gpus)) != len(gpus):
            raise ConfigError(
                f"strategy {self.name!r} got the same GPU twice ({', '.join(map(str, devices))})"
                ": list each GPU once"
            )
        super().configure(devices)
        self.output_device = self._member("output_device", self.output_device_spec)

    def _member(self, what: str, spec: DeviceSpec | None) -> torch.device:
        """A device given as an index into the devices or as a spec; it must be one of them."""
        if spec is None:
            return self.devices[0].torch
        listing = ", ".join(map(str, self.devices))
        if isinstance(spec, int) and not isinstance(spec, bool):
            if 0 <= spec < len(self.devices):
                return self.devices[spec].torch
            raise ConfigError(
                f"{what}={spec} is not a position among the strategy's {len(self.devices)} "
                f"devices ({listing}): give 0..{len(self.devices) - 1}, or a device spec"
            )
        chosen = resolve_device(spec)
        if chosen not in self.devices:
            raise ConfigError(
                f"{what}={described(spec)} is not one of the strategy's devices ({listing}): "
                "give one of them, or its position"
            )
        return chosen.torch

    @property
    def driven_devices(self) -> list[Device]:
        return list(self.devices)

    # What running out of memory most likely means under this strategy: (title, why, fix,
    # the imbalance to assume when none was measured, confidence with and without one).
    memory_story: ClassVar[tuple[str, str, str, float, float, float]] = (
        "balance memory over GPUs",
        'under strategy "dp" GPU 0 gathers every output and computes the loss alone',
        'strategy="dp-balanced" computes the loss on every GPU, and strategy="ddp" balances '
        "memory fully",
        1.5,  # a typical dp imbalance
        0.8,
        0.5,
    )

    def enable_compile(self, backend: str | None, mode: str | None = None) -> bool:
        raise ConfigError(
            f"compile: strategy {self.name!r} copies the model onto every device at each step "
            "(torch's DataParallel), which torch.compile cannot follow: use strategy='ddp' (one "
            "process per device, compiled; `gpukit train --strategy ddp --compile`), or drop "
            "compile"
        )

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        devices = [d.torch for d in self.devices]
        return DataParallelModule(module, devices, self.output_device, self.gather_outputs)

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DataParallelModule) else module


class DPBalanced(DP):
    """``dp`` whose outputs stay on their devices and whose loss is computed on every device.

    Args:
        loss_device: where the weighted sum of the per-device losses (one scalar) is made,
            and so where ``rt.backward`` starts (default: the first device, with the master
            weights). Only scalars travel there, so the choice barely changes memory.

    >>> import gpukit as gk
    >>> rt = gk.Runtime(strategy=gk.strategies.DPBalanced(loss_device=1), devices=["cpu", "cpu"])
    >>> rt.strategy.loss_device
    device(type='cpu')
    """

    name: ClassVar[str] = "dp-balanced"
    gather_outputs: ClassVar[bool] = False
    traits: ClassVar[Traits] = Traits(
        drives_all_devices=True, min_devices=2, collectives=_DP_COLLECTIVES
    )

    def __init__(self, *, loss_device: DeviceSpec | None = None) -> None:
        super().__init__()
        self.loss_device_spec = _checked_member("loss_device", loss_device)

    def configure(self, devices: list[Device]) -> None:
        super().configure(devices)
        self.loss_device = self._member("loss_device", self.loss_device_spec)

    memory_story: ClassVar[tuple[str, str, str, float, float, float]] = (
        "one replica per process",
        'under strategy "dp-balanced" the first GPU still holds the master weights, all '
        "gradients and the whole optimizer state",
        'strategy="ddp" gives every GPU its own replica and its own share of the work, and '
        "sharding the optimizer state over GPUs (FSDP / ZeRO) shrinks it further",
        1.2,  # the master state on the first GPU
        0.7,
        0.4,
    )

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: str | None
    ) -> Callable[..., torch.Tensor]:
        check_criterion(fn, reduction)
        reduces = reduction_of(fn, reduction)
        if isinstance(fn, nn.Module):
            fn = fn.to(self.devices[0].torch)
        return ParallelCriterion(fn, self.loss_device, reduces)


def _checked_member(what: str, spec: DeviceSpec | None) -> DeviceSpec | None:
    """``spec`` as given, once its spelling is known to be a device or a position (whether it
    is one of the strategy's devices is known only when they are given, in ``configure``)."""
    if spec is None or isinstance(spec, Device):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        if spec < 0:
            raise ConfigError(f"{what}={spec}: give a position 0, 1, ... among the devices")
        return spec
    try:
        parse(spec)
    except SpecError as err:
        raise ConfigError(
            f"{what}={described(spec)}: {err.problem}; give a position among the strategy's "
            f"devices (0, 1, ...) or one of them ({err.fix})"
        ) from None
    return spec
