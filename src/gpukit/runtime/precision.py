"""Numeric precision of training: one small class per setting.

- ``"32"``: plain float32; nothing wraps the forward.
- ``"bf16-mixed"``: the forward runs under ``torch.autocast`` in bfloat16; weights and
  gradients stay float32.
- ``"16-mixed"``: autocast in float16 plus a gradient scaler, which skips the optimizer step
  when gradients overflow (inf/NaN) and lowers the scale, or raises it after a run of good steps.
- ``"auto"``: bf16-mixed on GPUs that support it, 16-mixed on older GPUs, 32 on the CPU.

>>> from gpukit.runtime.precision import make_precision
>>> import torch
>>> make_precision("auto", torch.device("cpu")).name
'32'
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import nn

from gpukit._util.tree import map_tensors
from gpukit.errors import ConfigError

PrecisionName = Literal["32", "bf16-mixed", "16-mixed", "auto"]
NAMES: tuple[str, ...] = get_args(PrecisionName)


class Precision:
    """Float32: the base class, and the setting where every hook does the plain thing."""

    name: ClassVar[str] = "32"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wrap_forward(self, module: nn.Module) -> None:
        """Make ``module``'s forward run in this precision; float32 leaves it untouched."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true size before clipping (only a scaler changes them)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (overflowing gradients)."""
        optimizer.step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""


class BF16Mixed(Precision):
    """Autocast the forward to bfloat16; no scaler needed (bf16 has float32's range)."""

    name: ClassVar[str] = "bf16-mixed"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    def wrap_forward(self, module: nn.Module) -> None:
        # An instance attribute shadows the class's forward: module(...) and DDP's call of it
        # both run under autocast, and the module's type and state_dict keys stay the user's.
        module.forward = _autocast(module.forward, self.device.type, self.dtype)


class FP16Mixed(BF16Mixed):
    """Autocast to float16 with a gradient scaler (float16 overflows and underflows easily)."""

    name: ClassVar[str] = "16-mixed"
    dtype: ClassVar[torch.dtype] = torch.float16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(device.type)
        self._unscaled = False

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        # Whether the step ran is seen by a hook on the optimizer, not by comparing the scale
        # before and after: each get_scale() reads a GPU value back, two more waits per step
        # on top of the one the scaler needs to look for inf/NaN.
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            # A fused optimizer (Adam(fused=True), ...) is always called and skips on the
            # device by itself, so only the scale tells whether it skipped.
            scale_before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            return self.scaler.get_scale() >= scale_before
        ran: list[bool] = []
        hook = optimizer.register_step_pre_hook(lambda *_: ran.append(True))
        try:
            self.scaler.step(optimizer)  # skipped when the gradients hold inf or NaN
        finally:
            hook.remove()
        self.scaler.update()  # and then the scale goes down
        return bool(ran)

    @property
    def scale(self) -> float:
        return float(self.scaler.get_scale())

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


_CLASSES: dict[str, type[Precision]] = {c.name: c for c in (Precision, BF16Mixed, FP16Mixed)}


def make_precision(name: str, device: torch.device) -> Precision:
    """The precision object for ``name`` on ``device``; "auto" picks by the hardware.

    >>> import torch
    >>> make_precision("bf16-mixed", torch.device("cpu")).name
    'bf16-mixed'
    """
    if name == "auto":
        name = _auto_name(device)
    if name not in _CLASSES:
        raise ConfigError(
            f"unknown precision {name!r}: use one of {', '.join(NAMES)} "
            "(e.g. precision='bf16-mixed')"
        )
    if name == "16-mixed" and device.type != "cuda":
        raise ConfigError(
            f"precision '16-mixed' needs a CUDA GPU, but the device is {device}: float16 "
            "autocast is slow or missing there (use 'bf16-mixed' or '32' on the CPU)"
        )
    if name == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision 'bf16-mixed' needs a GPU with bfloat16 (compute capability 8.0+), but "
            f"{torch.cuda.get_device_name(device)} has none: use '16-mixed' (or 'auto')"
        )
    return _CLASSES[name](device)


def _auto_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "32"
    major, _ = torch.cuda.get_device_capability(device)
    return "bf16-mixed" if major >= 8 else "16-mixed"


def _autocast(forward: Callable[..., Any], device_type: str, dtype: torch.dtype) -> Any:
    @functools.wraps(forward)
    def forward_in_precision(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        # The loss is computed outside autocast: give it float32 outputs, as a float32 model
        # would, so losses and metrics are not rounded to 8 bits of mantissa.
        return _to_float32(output)

    return forward_in_precision


def _to_float32(value: Any) -> Any:
    return map_tensors(
        value, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    )
