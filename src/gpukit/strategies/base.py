"""The strategy contract: how a model, its gradients and its ranks are spread over devices.

A strategy never imports the Runtime; the Runtime calls these hooks and never asks which
strategy it holds. Everything that differs between strategies is a method here, its
out-of-memory recovery an object of its own (:class:`Recovery`), and what it costs in memory
and communication data that the planner reads (:class:`~gpukit.strategies.traits.Traits`).

A strategy must say which devices it takes (``configure``), how it places or wraps the model
(``setup_module``) and how to get the user's model back (``unwrap``); every other hook has
a default that fits one process computing on one device.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from gpukit._util.checks import require_module
from gpukit._util.text import described
from gpukit.devices.device import Device
from gpukit.errors import ConfigError
from gpukit.strategies.float8 import (
    check_float8_device,
    check_float8_precision,
    convert_float8,
)
from gpukit.strategies.meta_init import MetaInit, is_meta, user_model
from gpukit.strategies.traits import Traits

ReduceOp = Literal["mean", "sum", "max", "min"]


@dataclass(frozen=True)
class MemoryAdvice:
    """A strategy's own remedy for running out of memory: ``title`` and ``detail`` in words,
    ``freed`` the bytes it would free on the device that failed (None: unknown), and
    ``confidence`` (0..1) that it is the cause."""

    title: str
    detail: str
    freed: int | None
    confidence: float


class Recovery:
    """What a strategy does when a device runs out of memory: the hooks the Runtime's retry
    and ``gk.explain`` call, kept apart from the everyday contract (``strategy.recovery``).
    This default fits a strategy whose forward and backward run no collective: nothing to
    hold back, nothing to reset, no advice of its own. Subclasses override what differs.

    >>> import gpukit as gk
    >>> rt = gk.Runtime(strategy="single", devices="cpu")
    >>> rt.strategy.recovery.supported, rt.strategy.recovery.advice(None, None)
    (True, None)
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy

    @property
    def supported(self) -> bool:
        """Whether a step can be redone after some rank ran out of memory halfway (not when
        the forward itself talks to the other ranks)."""
        return True

    def hold_sync(self, module: nn.Module, first: bool) -> None:
        """Make the coming forward and backward run no collective at all (a rank may fail
        halfway, and no other rank may wait for it). ``first``: the attempt's first
        micro-batch, before which every rank is still together (where a strategy shares what
        its forward would have shared)."""

    def held_flags(self, module: nn.Module) -> list[bool]:
        """What this rank must tell the others before ``sync_held`` (agreed by ``any_rank``
        together with the step's own flags, so that the whole agreement is one read)."""
        return []

    def sync_held(self, module: nn.Module, anywhere: list[bool]) -> None:
        """Do now what ``hold_sync`` held back: average the gradients.
        ``anywhere``: ``held_flags`` agreed over the ranks."""

    def reset_module(self, module: nn.Module) -> None:
        """Put ``module`` back in order after a forward or backward failed halfway."""

    def advice(self, peak: int | None, imbalance: float | None) -> MemoryAdvice | None:
        """This strategy's own remedy when a device runs out of memory (``peak``: bytes the
        failing device held at its peak; ``imbalance``: max/min peak over the devices this
        process drives), or None when it has none to add."""
        return None


class Strategy(abc.ABC):
    """Base class. Subclasses set ``name`` and ``traits``, implement the abstract hooks and
    override what else they do differently."""

    name: ClassVar[str]
    # What the planner reads: memory and communication (see strategies/traits.py).
    traits: ClassVar[Traits]
    # What runs when a device runs out of memory (see ``recovery``).
    recovery_class: ClassVar[type[Recovery]] = Recovery
    # How a model built on the meta device is initialised (the Runtime sets the run's).
    meta_init: MetaInit = MetaInit()
    # The torchao float8 recipe the Linear layers compute in, for strategies with a
    # ``float8=`` setting (see gpukit.strategies.float8); None: no float8.
    float8: str | None = None
    # Hooks with an empty body are optional (B027): doing nothing is right for one process.

    def __init__(self) -> None:
        self.devices: list[Device] = []
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1

    @property
    def device(self) -> Device:
        """The device this process computes on."""
        return self.devices[self.local_rank]

    def __repr__(self) -> str:
        """What ``print(rt.strategy)`` shows: the class, its processes, and this process's
        device (``device=none`` before the devices are given)."""
        shown = ", ".join(f"{k}={v}" for k, v in self.described().items())
        return f"{type(self).__name__}({shown})"

    def described(self) -> dict[str, object]:
        """The fields of ``repr``: ``world_size``, ``rank`` where there are several, and the
        device (``devices`` for a strategy that drives several from one process)."""
        fields: dict[str, object] = {"world_size": self.world_size}
        if self.world_size > 1:
            fields["rank"] = self.rank
        if not self.devices:
            fields["device"] = "none"
        elif len(self.driven_devices) > 1:
            fields["devices"] = "[" + ", ".join(str(d.torch) for d in self.driven_devices) + "]"
        else:
            fields["device"] = str(self.device.torch)
        return fields

    @abc.abstractmethod
    def configure(self, devices: list[Device]) -> None:
        """Take the devices asked for; raise ConfigError if this strategy cannot use them.
        The base keeps them: call it once they are checked."""
        for device in devices:
            check_float8_device(self.float8, device)
        self.devices = devices

    @property
    def driven_devices(self) -> list[Device]:
        """The devices this process computes on: its own one, or every device under ``dp``.
        Only their random generators and memory are this process's to read."""
        return [self.device]

    @property
    def distributed(self) -> bool:
        """True when several processes train together: decisions must then be agreed on."""
        return self.world_size > 1

    @property
    def splits_model(self) -> bool:
        """True when ranks hold different parts of the model (pipeline stages): the whole
        model's weights are then gathered from several ranks."""
        return False

    @property
    def recovery(self) -> Recovery:
        """Out-of-memory recovery under this strategy: holding collectives back, resetting a
        model after a failed pass, the strategy's own advice."""
        return self.recovery_class(self)

    @classmethod
    def for_simulation(cls, *, activation_checkpointing: str = "off") -> Strategy:
        """A strategy of this kind as the planner's simulation runs it over fake tensors
        (``activation_checkpointing``: the strategy's own setting, where its traits say it
        has one)."""
        return cls()

    @property
    def needs_launch(self) -> bool:
        """True when more processes must be started before training can begin."""
        return False

    def setup_environment(self) -> None:
        """Prepare this process: current CUDA device, process group."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index)

    def check_precision(self, precision: str) -> None:
        """Refuse a run ``precision`` (its name) this strategy's own settings cannot go with."""
        if self.float8 is not None:
            check_float8_precision(self.float8, self.device, precision, bf16=False)

    def enable_compile(self, backend: str | None, mode: str | None = None) -> bool:
        """The run compiles its model with ``torch.compile`` (``backend``: None for torch's
        default; ``mode``: inductor's mode, None for its default); raise ConfigError where
        this strategy cannot. True: the Runtime compiles, in
        place, what ``setup_module`` returns (so DDP's wrapper is inside the compiled call, as
        torch recommends); False: this strategy compiles in ``setup_module`` itself."""
        return True

    @abc.abstractmethod
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Place the model; return what the training loop should call. The base places it on
        this process's device (a meta-device model: materialised whole there and initialised,
        see ``gpukit.strategies.meta_init``)."""
        module = require_module(module, "rt.setup", meta=True)
        if is_meta(module):
            self.meta_init.check(user_model(module))
            self.meta_init.materialise(user_model(module), self.device.torch)
        else:
            self.meta_init.not_used(user_model(module))
        module = place(module, self.device.torch)
        if self.float8 is not None:
            convert_float8(user_model(module), self.float8, self.device, fsdp=False, rank=self.rank)
        return module

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: str | None
    ) -> Callable[..., torch.Tensor]:
        """The loss function as this strategy computes it (the function itself by default).
        ``reduction`` says how ``fn`` reduces over samples ("mean" or "sum"), when known."""
        check_criterion(fn, reduction)
        return fn

    def loss_weight(self, weight: float) -> None:  # noqa: B027
        """The coming forward's loss is weighted by ``weight`` before its backward
        (``1/accumulate``, or a micro-batch's share of ``rt.train_step``'s batch): a strategy
        whose forward runs the backward itself (a pipeline schedule) weighs the loss there."""

    def backward_done(self, loss: torch.Tensor) -> bool:
        """True when ``loss``'s backward already ran with its forward (a pipeline schedule
        runs both): the Runtime then runs none, and counts the micro-step as usual."""
        return False

    @abc.abstractmethod
    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own model inside whatever ``setup_module`` returned."""

    def set_backward_sync(self, module: nn.Module, enabled: bool) -> None:  # noqa: B027
        """Whether the next backward should synchronise gradients across ranks."""

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of ``params`` to a total norm of at most ``max_norm``; the
        total norm before, on the device (no read)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def gradient_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """The total norm of ``grads`` where this strategy must compute it itself (gradients
        on several device meshes); None: the plain norm of the tensors is right."""
        return None

    def after_optimizer_step(self, module: nn.Module) -> None:  # noqa: B027
        """Called after each optimizer step with each set-up ``module`` (stepped or not, on
        every rank alike), and after a load replaced the weights: where a strategy prepares
        what the next forward derives from the weights (the scales of weights gathered in
        float8). Weights changed by hand in between are not seen."""

    def check_model(self, module: nn.Module) -> None:  # noqa: B027
        """Refuse a ``module`` this strategy cannot split as configured (heads, layers or a
        sequence that does not divide by its ranks), before any process or collective: a
        launcher asks it of the model (on the meta device) before it starts the ranks."""

    def check_gradients(self, module: nn.Module) -> None:  # noqa: B027
        """Called once after the first backward, to catch setups that fail a step later."""

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag, True where it is True on at least one rank: how ranks agree on a
        decision (one small all-reduce and one read under several processes; free alone)."""
        return list(flags)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` combined over all ranks (a new tensor; the input is left alone)."""
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each), stacked in rank order."""
        return tensor.detach().unsqueeze(0).clone()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        return [obj]

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` on every rank (a new tensor)."""
        return tensor.detach().clone()

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:  # noqa: B027
        """Wait until every rank reaches this point."""

    def background_group(self) -> Any:
        """The process group for collectives run on a thread beside training (a checkpoint
        written in the background); None alone, where nothing needs one."""
        return None

    def check_every_rank_calls(self, what: str) -> None:  # noqa: B027
        """Before a collective that only some ranks might call (``rt.save`` under
        ``if rank == 0``): fail within a short timeout naming the ranks that did not come,
        instead of waiting in the collective for the whole process-group timeout."""

    def sampler_placement(self) -> tuple[int, int]:
        """(number of data shards, this rank's shard) for the data loader."""
        return self.world_size, self.rank

    def local_batch(self, batch: Any) -> Any:
        """The part of ``batch`` (on the device, from the data loader) this rank computes on:
        the batch itself, except where ranks split each sample (context parallel: this
        rank's chunks of every sequence)."""
        return batch

    def whole_samples(self, data: Any) -> Any:
        """``data``, what this rank computed from its part of a batch, with each sample made
        whole again where ranks split samples (context parallel: every tensor of two or more
        dimensions gathered along the sequence from the other ranks of its group); ``data``
        itself by default. Collective where it gathers: every rank calls it."""
        return data

    def teardown(self) -> None:  # noqa: B027
        """Release what ``setup_environment`` took."""


def check_criterion(fn: object, reduction: object) -> None:
    """Refuse a loss function that cannot be called, or a ``reduction`` that is not one of
    None, "mean" and "sum" (what ``rt.setup_criterion`` accepts).

    >>> check_criterion(torch.nn.MSELoss(), "sum")
    >>> check_criterion(None, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: rt.setup_criterion got None: ...
    """
    if not callable(fn) or isinstance(fn, type):
        raise ConfigError(
            f"rt.setup_criterion got {described(fn)}: pass the loss function or module "
            "itself, e.g. rt.setup_criterion(nn.CrossEntropyLoss()) or F.cross_entropy"
        )
    if reduction is not None and not (isinstance(reduction, str) and reduction in _REDUCTIONS):
        raise ConfigError(
            f"rt.setup_criterion(reduction={described(reduction)}): give 'mean' (the loss is "
            "the mean over its samples), 'sum', or None (the loss module's own, else 'mean')"
        )


_REDUCTIONS = ("mean", "sum")


def place(module: nn.Module, device: torch.device) -> nn.Module:
    """``module.to(device)``, skipped when every parameter and buffer is there already: it
    would change nothing, and skipping it lets fake tensors (the planner's simulation), which
    ``.to()`` cannot swap in place, pass through.

    >>> m = nn.Linear(2, 2)
    >>> place(m, torch.device("cpu")) is m
    True
    """
    held = [*module.parameters(), *module.buffers()]
    here = all(
        t.device.type == device.type and (t.device.index or 0) == (device.index or 0) for t in held
    )
    return module if held and here else module.to(device)
