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

``compile`` also takes one of ``torch.compile``'s modes (``MODES``) in place of a backend:
inductor with that mode. The modes that record CUDA graphs ("reduce-overhead",
"max-autotune") replay a step's kernels with one launch, for a small model whose GPU waits on
the host; a graph holds fixed shapes and one device, so they are refused with several
processes or devices (collectives) and with batches whose shape changes (a loader's short last
batch, checked at ``rt.setup``), with accumulation and with ``oom="recover"`` (``"auto"``
does not recover under them), and on a CPU they compile without graphs, as said once.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpukit._util.text import described
from gpukit.errors import ConfigError, warn_user
from gpukit.runtime.step.precision import MixedPrecision
from gpukit.strategies import Strategy

# torch.compile's modes (inductor's): given as ``compile``, the default backend in that mode.
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# The modes that record CUDA graphs of the compiled model.
GRAPH_MODES = ("reduce-overhead", "max-autotune")


def check_compile(value: object) -> None:
    """Refuse a ``compile`` setting that is not False, True, a mode or a backend's name, and
    any but False where this torch cannot compile."""
    if value is False:
        return
    if value is not True and not (isinstance(value, str) and value):
        raise ConfigError(
            f"compile={described(value)}: give True (torch.compile with its default backend, "
            f"inductor), False, a mode ({', '.join(MODES)}), or the name of a torch.compile "
            "backend such as 'aot_eager'"
        )
    supported, why = _dynamo_supported()
    if not supported:
        raise ConfigError(
            f"compile={value!r}: torch.compile does not run with torch {torch.__version__} on "
            f"Python {platform.python_version()} ({sys.platform}): {why}. Install a torch that "
            "supports it on this platform (see pytorch.org), or drop compile"
        )
    if isinstance(value, str) and value not in MODES:
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if value not in known:
            raise ConfigError(
                f"compile={value!r}: neither a torch.compile mode ({', '.join(MODES)}) nor a "
                f"backend here; the backends are: {', '.join(sorted(known))} (True: the "
                "default, inductor)"
            )


def check_graph_mode(value: object, accumulate: int, oom: str) -> None:
    """Refuse a CUDA-graph mode with what changes a step's shapes or its number of forwards:
    accumulation (several forwards before one backward) and ``oom="recover"`` (a batch cut into
    smaller ones). ``oom="auto"`` does not recover under such a mode (see ``Settings``)."""
    if value not in GRAPH_MODES:
        return
    if accumulate > 1:
        raise ConfigError(
            f"compile={value!r} records CUDA graphs of one forward and backward per step, and "
            f"accumulate={accumulate} runs {accumulate} forwards before the step: use "
            "compile=True (no CUDA graphs), or a larger batch and accumulate=1"
        )
    if oom == "recover":
        raise ConfigError(
            f"compile={value!r} records CUDA graphs for fixed shapes, and oom='recover' cuts a "
            "batch that does not fit into smaller ones, each recorded again in the memory that "
            "just ran out: use oom='raise' (or 'auto', which does not recover under CUDA "
            "graphs), or compile=True"
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
    """How a Runtime compiles the models it sets up: ``setting`` is its ``compile``.
    ``graphs``: the compiled model replays CUDA graphs (a graph mode on a CUDA device)."""

    def __init__(self, setting: bool | str, strategy: Strategy) -> None:
        self.enabled = setting is not False
        self.mode = setting if isinstance(setting, str) and setting in MODES else None
        self.backend = setting if isinstance(setting, str) and self.mode is None else None
        # False also where the strategy compiles the model itself (fsdp: per block).
        self.outer = self.enabled and strategy.enable_compile(self.backend, self.mode)
        self.graphs = self.mode is not None and _graphs(self.mode, strategy)

    def before_strategy(self, module: nn.Module, user: nn.Module) -> nn.Module:
        """The module the strategy is given: at float32 (``module`` is the user's own), in
        a thin wrapper, so that compiling never touches the user's module."""
        return PlainCall(module) if self.outer and module is user else module

    def after_strategy(self, module: nn.Module) -> nn.Module:
        """What the strategy returned, compiled in place (the same object: names unchanged)."""
        if self.outer:
            if self.mode is not None:
                module.compile(mode=self.mode)
            else:
                module.compile(**({"backend": self.backend} if self.backend else {}))
        return module

    def step(self, take_step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``take_step()``'s loss; under CUDA graphs a new replay begins first, and the loss
        is copied: a new step may overwrite the last one's graph outputs, and the loss a model
        returns itself is one of them. The copy (one scalar kernel, no host read) outlives the
        next replay in ``rt.log``'s window."""
        if not self.graphs:
            return take_step()
        torch.compiler.cudagraph_mark_step_begin()
        return take_step().clone()

    def next_step(self) -> None:
        """After ``rt.step`` in a loop of its own: under CUDA graphs, the next forward begins
        a new replay (as ``step`` does for ``rt.train_step``)."""
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def check_loader(self, loader: Any) -> None:
        """Refuse a loader whose batches change shape when the model replays CUDA graphs: a
        graph holds the shapes it was recorded with, so each new shape records (and keeps)
        another; a short last batch is the common case, and the one known before a pass."""
        if not self.graphs or getattr(loader, "drop_last", True):
            return
        size = getattr(loader, "batch_size", None)
        try:
            samples = len(loader.dataset)
        except TypeError:  # a dataset without a length: its batches are not known up front
            return
        if size and samples % size:
            raise ConfigError(
                f"compile={self.mode!r} records CUDA graphs for fixed shapes, but this "
                f"DataLoader's last batch has {samples % size} samples, not batch_size={size} "
                f"({samples} samples): pass drop_last=True to the DataLoader, or use "
                "compile=True (no CUDA graphs), which handles a changing shape"
            )


def _graphs(mode: str, strategy: Strategy) -> bool:
    """Whether ``mode`` replays CUDA graphs under ``strategy``; ConfigError for a graph mode
    over several processes or devices."""
    if mode not in GRAPH_MODES:
        return False
    devices = max(strategy.world_size, len(strategy.driven_devices))
    if strategy.traits.collectives or devices > 1:
        raise ConfigError(
            f"compile={mode!r} records CUDA graphs, which replay one device's kernels without "
            f"the collectives of strategy {strategy.name!r} (over {devices} device(s)): use "
            "compile=True (or 'max-autotune-no-cudagraphs'), or strategy='single' on one device"
        )
    if strategy.device.type != "cuda":
        warn_user(
            f"compile={mode!r}: CUDA graphs need a CUDA device, and this run trains on "
            f"{strategy.device.type}: the model is compiled in this mode without them"
        )
        return False
    return True
