"""``gk.Runtime(compile=True)``: the model under ``torch.compile``, with every strategy that can.

What is compiled, and in which order, follows torch's advice for each case:

- single and ddp: what the strategy returns is compiled in place (``nn.Module.compile``): under
  ddp that is DDP's wrapper, so dynamo sees DDP and splits the graph at its gradient buckets
  (DDPOptimizer), keeping the all-reduce of each bucket behind the backward; a compiled
  module inside DDP would all-reduce only after the whole backward. Mixed precision's
  autocast wrapper sits inside and is compiled with the model (autocast in the graph, outputs
  cast to float32 without a recompile per step, see ``gpukit.runtime.step.precision``). At float32,
  where nothing wraps the user's model, a thin wrapper of the same kind takes its place, so the
  user's own module is never compiled: ``rt.unwrap(model)`` is the plain module (a generation
  loop over it does not recompile), and ``rt.teardown`` leaves it as it was given.
- fsdp: each repeated block is compiled before it is sharded (``FSDP(compile="blocks")``, as
  torchtitan does), so that the sharding hooks stay between compiled graphs.
- dp and dp-balanced copy the module onto the devices at every step: refused, naming ddp.

Compiling in place keeps the module objects: parameter names, ``state_dict`` keys and
checkpoints are those of an uncompiled run (no ``_orig_mod.``), so either loads the other's.

>>> import torch, gpukit as gk
>>> rt = gk.Runtime(devices="cpu", compile="eager")
>>> model = rt.setup(torch.nn.Linear(2, 1))
>>> list(model.state_dict()), rt.unwrap(model) is not model
(['weight', 'bias'], True)
"""

from __future__ import annotations

import platform
import sys
from typing import Any

import torch
from torch import nn

from gpukit._util.text import described
from gpukit.errors import ConfigError
from gpukit.runtime.step.precision import MixedPrecision
from gpukit.strategies import Strategy


def check_compile(value: object) -> None:
    """Refuse a ``compile`` setting that is not False, True or a backend's name, and any but
    False where this torch cannot compile."""
    if value is False:
        return
    if value is not True and not (isinstance(value, str) and value):
        raise ConfigError(
            f"compile={described(value)}: give True (torch.compile with its default backend, "
            "inductor), False, or the name of a torch.compile backend such as 'aot_eager'"
        )
    supported, why = _dynamo_supported()
    if not supported:
        raise ConfigError(
            f"compile={value!r}: torch.compile does not run with torch {torch.__version__} on "
            f"Python {platform.python_version()} ({sys.platform}): {why}. Install a torch that "
            "supports it on this platform (see pytorch.org), or drop compile"
        )
    if isinstance(value, str):
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if value not in known:
            raise ConfigError(
                f"compile={value!r}: not a torch.compile backend here; these are: "
                f"{', '.join(sorted(known))} (True: the default, inductor)"
            )


def _dynamo_supported() -> tuple[bool, str]:
    try:
        from torch._dynamo.eval_frame import check_if_dynamo_supported
    except Exception as err:  # a build without dynamo at all
        return False, f"torch._dynamo cannot be imported ({err})"
    try:
        check_if_dynamo_supported()
    except Exception as err:  # Windows or a Python too new for this torch
        return False, str(err).strip() or type(err).__name__
    return True, ""


class PlainCall(MixedPrecision):
    """The user's model, called as it is (no autocast, outputs untouched), in a wrapper as
    transparent as mixed precision's: what a float32 run compiles in place of the user's own
    module. ``rt.unwrap`` sees through it like through autocast's wrapper.

    >>> import torch
    >>> m = PlainCall(torch.nn.Linear(2, 2))
    >>> list(m.state_dict()), m.in_features
    (['weight', 'bias'], 2)
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module, "cpu", torch.float32)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class Compiler:
    """How a Runtime compiles the models it sets up: ``setting`` is its ``compile``."""

    def __init__(self, setting: bool | str, strategy: Strategy) -> None:
        self.enabled = setting is not False
        self.backend = setting if isinstance(setting, str) else None
        # False also where the strategy compiles the model itself (fsdp: per block).
        self.outer = self.enabled and strategy.enable_compile(self.backend)

    def before_strategy(self, module: nn.Module, user: nn.Module) -> nn.Module:
        """The module the strategy is given: at float32 (``module`` is the user's own), in
        a thin wrapper, so that compiling never touches the user's module."""
        return PlainCall(module) if self.outer and module is user else module

    def after_strategy(self, module: nn.Module) -> nn.Module:
        """What the strategy returned, compiled in place (the same object: names unchanged)."""
        if self.outer:
            module.compile(**({"backend": self.backend} if self.backend else {}))
        return module
