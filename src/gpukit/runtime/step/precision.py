"""Numeric precision of training: one small class per setting.

- ``"32"``: plain float32; nothing wraps the forward. The Runtime's default: a program moved
  onto gpukit computes as it did before unless it asks for less.
- ``"bf16-mixed"``: the forward runs under ``torch.autocast`` in bfloat16; weights and
  gradients stay float32. ``setup`` puts the model inside a thin :class:`MixedPrecision`
  module that enters autocast around each call: the user's module itself is never changed.
- ``"16-mixed"``: autocast in float16 plus a gradient scaler, which skips the optimizer step
  when gradients overflow (inf/NaN) and lowers the scale, or raises it after a run of good steps.
- ``"auto"``: bf16-mixed on GPUs that support it, 16-mixed on older GPUs, 32 on the CPU
  (``gpukit train``'s default).

>>> from gpukit.runtime.step.precision import make_precision
>>> import torch
>>> make_precision("auto", torch.device("cpu")).name
'32'
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, get_args

import torch
import torch.utils._pytree as pytree
from torch import nn

from gpukit._util.checks import require_module
from gpukit._util.text import described
from gpukit._util.tree import map_tensors
from gpukit._util.wrapping import pickled_as_model
from gpukit.errors import ConfigError

PrecisionName = Literal["32", "bf16-mixed", "16-mixed", "auto"]
NAMES: tuple[str, ...] = get_args(PrecisionName)


class Precision:
    """Float32: the base class, and the setting where every hook does the plain thing."""

    name: ClassVar[str] = "32"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        """``Precision(32, device=cpu)``, ``BF16Mixed(bf16-mixed, device=cuda:0)``."""
        return f"{type(self).__name__}({self.name}, device={self.device})"

    def setup_module(self, module: nn.Module) -> nn.Module:
        """What runs ``module``'s forward in this precision; float32: the module itself."""
        return require_module(module, "rt.setup", meta=True)

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module ``setup_module`` was given."""
        return module.module if isinstance(module, MixedPrecision) else module

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true size before clipping (only a scaler changes them)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped (overflowing gradients)."""
        try:
            step = optimizer.step
        except AttributeError:
            raise _not_an_optimizer(optimizer) from None
        step()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""


class BF16Mixed(Precision):
    """Autocast the forward to bfloat16; no scaler needed (bf16 has float32's range)."""

    name: ClassVar[str] = "bf16-mixed"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    def setup_module(self, module: nn.Module) -> nn.Module:
        require_module(module, "rt.setup", meta=True)
        return MixedPrecision(self.unwrap(module), self.device.type, self.dtype)


class FP16Mixed(BF16Mixed):
    """Autocast to float16 with a gradient scaler (float16 overflows and underflows easily)."""

    name: ClassVar[str] = "16-mixed"
    dtype: ClassVar[torch.dtype] = torch.float16

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(device.type)

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
            # The scales are compared on the device and read once (get_scale() twice would
            # be two reads); the scaler's own tensor is private, hence the fallback.
            scale = getattr(self.scaler, "_scale", None)
            if not isinstance(scale, torch.Tensor):
                before = self.scaler.get_scale()
                self.scaler.step(optimizer)
                self.scaler.update()
                return self.scaler.get_scale() >= before
            before_t = scale.clone()
            self.scaler.step(optimizer)
            self.scaler.update()  # updates that same tensor in place
            return bool(scale >= before_t)
        try:
            register = optimizer.register_step_pre_hook
        except AttributeError:
            raise _not_an_optimizer(optimizer) from None
        ran: list[bool] = []
        hook = register(lambda *_: ran.append(True))
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
    if isinstance(name, str) and name == "auto":
        name = _auto_name(device)
    if not isinstance(name, str) or name not in _CLASSES:
        numeric = isinstance(name, int) and not isinstance(name, bool)
        hint = f" (the name is the string {str(name)!r})" if numeric else ""
        raise ConfigError(
            f"unknown precision {described(name)}{hint}: use one of {', '.join(NAMES)} "
            "(e.g. precision='bf16-mixed')"
        )
    cuda = device.type == "cuda"
    # Asked only where it matters: the question initialises CUDA.
    bf16 = name != "bf16-mixed" or not cuda or torch.cuda.is_bf16_supported()
    shown = str(device) if bf16 else torch.cuda.get_device_name(device)
    refuse_on_device(name, shown, cuda=cuda, bf16=bf16)
    return _CLASSES[name](device)


def refuse_on_device(name: str, device: str, *, cuda: bool, bf16: bool) -> None:
    """Refuse precision ``name`` where ``device`` cannot run it (``cuda``: a CUDA GPU;
    ``bf16``: it computes bfloat16): the one check of ``gk.Runtime``, ``gpukit train`` and
    ``gpukit plan``, so that a plan never recommends what a run refuses.

    >>> refuse_on_device("16-mixed", "cpu", cuda=False, bf16=True)
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: precision '16-mixed' needs a CUDA GPU, but the device is cpu: ...
    """
    if name == "16-mixed" and not cuda:
        raise ConfigError(
            f"precision '16-mixed' needs a CUDA GPU, but the device is {device}: float16 "
            "autocast is slow or missing there (use 'bf16-mixed' or '32' on the CPU)"
        )
    if name == "bf16-mixed" and cuda and not bf16:
        raise ConfigError(
            f"precision 'bf16-mixed' needs a GPU with bfloat16 (compute capability 8.0+), but "
            f"{device} has none: use '16-mixed' (or 'auto')"
        )


def _not_an_optimizer(optimizer: object) -> ConfigError:
    return ConfigError(
        f"the optimizer is {described(optimizer)}, not a torch.optim.Optimizer: pass the "
        "optimizer that rt.setup returned, e.g. rt.step(optimizer) or "
        "rt.train_step(optimizer, batch, compute_loss)"
    )


def _auto_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "32"
    major, _ = torch.cuda.get_device_capability(device)
    return "bf16-mixed" if major >= 8 else "16-mixed"


class MixedPrecision(nn.Module):
    """Runs ``module`` under ``torch.autocast(device_type, dtype)`` and hands back float32.

    The loss is computed outside autocast: it gets float32 outputs, as from a float32 model, so
    losses and metrics are not rounded to 8 bits of mantissa. It sits inside the strategy's
    wrapper (DDP calls it as it would call the model), and is as transparent as a module can
    be: attributes, indexing, ``state_dict`` and ``load_state_dict`` are the wrapped model's
    own, and a wrapper above it (DDP) saves and loads the same keys as without mixed precision.
    What still shows it: ``named_parameters()`` and ``isinstance``; ``rt.unwrap(model)`` gives
    the model itself. Pickled (``torch.save(model, f)``) or copied (``copy.deepcopy``), it is
    the model alone, of the user's own class (see ``gpukit._util.wrapping``).

    >>> import torch
    >>> m = MixedPrecision(torch.nn.Linear(2, 2), "cpu", torch.bfloat16)
    >>> m(torch.ones(1, 2)).dtype, m.in_features, list(m.state_dict())
    (torch.float32, 2, ['weight', 'bias'])
    >>> import copy
    >>> type(copy.deepcopy(m)).__name__
    'Linear'
    """

    gpukit_thin_wrapper = True  # holds only the model: fsdp shards the model inside it

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        # state_dict() leaves this level out of the keys (below), so a state dict loaded
        # through a wrapper above arrives without it: put it back before the children load.
        register = getattr(self, "register_load_state_dict_pre_hook", None)
        if register is not None:
            register(_add_level)
        else:  # torch < 2.0 has only the private name
            self._register_load_state_dict_pre_hook(_add_level, with_module=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            output = self.module(*args, **kwargs)
        return _float_outputs(output)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

    # The ignores below: a container model (nn.Sequential) indexes and iterates; others raise
    # the same error they would raise unwrapped.
    def __getitem__(self, index: Any) -> Any:
        return self.module[index]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self.module)  # type: ignore[arg-type]

    def __iter__(self) -> Any:
        return iter(self.module)  # type: ignore[call-overload]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return pickled_as_model(self.module)


def _to_float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _float_outputs(output: Any) -> Any:
    """``output`` with its half-precision tensors turned float32.

    Under ``torch.compile`` (a program may compile the wrapped model), the walk must leave no
    guard on the objects it meets: map_tensors keys its memo by ``id()``, which dynamo guards
    on, so every step's new output tensor recompiled the frame until dynamo gave up (seen on
    torch 2.11, CUDA). A tensor, or plain lists, tuples and dicts of them (nanoGPT's
    ``(logits, loss)``), go through pytree, which compiles into the graph; anything else runs
    outside the graph (one graph break at the end of the forward), with the same result."""
    if isinstance(output, torch.Tensor):
        return _to_float(output)
    if not _compiling():
        return map_tensors(output, _to_float)
    leaves = pytree.tree_leaves(output)
    if all(isinstance(leaf, _PLAIN_LEAVES) for leaf in leaves):
        return pytree.tree_map_only(torch.Tensor, _to_float, output)
    return _eager_map_tensors(output, _to_float)


_PLAIN_LEAVES = (torch.Tensor, int, float, bool, str, type(None))


def _compiling() -> bool:
    return bool(torch.compiler.is_compiling())


def _eager_map_tensors(output: Any, fn: Any) -> Any:
    # Built on first use: decorating at import would import dynamo with gpukit.
    return torch.compiler.disable(map_tensors)(output, fn)


def _add_level(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """Load-time twin of ``MixedPrecision.state_dict``: keys under ``prefix`` gain the
    wrapper's own level (``module.``), which that state_dict left out."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[f"{prefix}module.{key[len(prefix) :]}"] = state_dict.pop(key)
