"""What a checkpoint reads from the live run and restores into it, declared here as the
narrow shapes it needs, so that the checkpoint sits below the Runtime and never imports it.

The Runtime's own objects meet these shapes (its ``TrainState``, ``DeviceLoader``,
``Scheduler`` and ``Precision``); so does any stand-in with the same members:

>>> import torch, types
>>> plain = types.SimpleNamespace(unwrap=lambda module: module)  # wraps nothing
>>> user_model(torch.nn.Linear(2, 1), plain, plain)
Linear(in_features=2, out_features=1, bias=True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn


class Unwraps(Protocol):
    """What puts a wrapper around the user's model at setup (the strategy, the precision)
    and tells the model inside."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module this one wraps (the module itself when it wraps none)."""
        ...


class Precision(Unwraps, Protocol):
    """The run's precision: its wrapper around the model, and its state (a gradient scaler's),
    saved with the run and checked against the live one before a load changes anything."""

    def state_dict(self) -> dict[str, Any]:
        """Each part of the state by name (``{"scaler": ...}``; ``{}``: none)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class Loader(Protocol):
    """A loader's place in its epoch, which a checkpoint saves and a resume goes on from."""

    @property
    def batch_size(self) -> int | None:
        """Samples per batch (None: the batches are the loader's own)."""
        ...

    @property
    def sampler(self) -> Any:
        """What the batches are drawn from (None for an iterable dataset)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` (batches into it) and ``batch_size``."""
        ...

    def pass_rng(self) -> dict[str, Any] | None:
        """The random state the current pass started from; None between passes."""
        ...

    def generator_states(self) -> list[torch.Tensor]:
        """The state now of each private generator its passes draw from."""
        ...

    def resume(
        self,
        epoch: int,
        position: int,
        rng: dict[str, Any] | None,
        generators: list[torch.Tensor] | None = None,
    ) -> None:
        """Go on from ``position`` batches into ``epoch``, the pass started from ``rng``, the
        private generators in the states ``generators``."""
        ...


class Scheduler(Protocol):
    """A learning-rate scheduler as the run steps it: the user's ``scheduler`` inside, and the
    steps owed to it when a checkpoint falls between an optimizer step and the program's call."""

    @property
    def scheduler(self) -> Any:
        """The user's own scheduler."""
        ...

    @property
    def per_step(self) -> bool | None:
        """Whether the program steps it once per optimizer step (None: not known yet)."""
        ...

    def owed(self) -> int:
        """Scheduler steps the program's next call owes."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the user's scheduler's state."""
        ...

    def settle(self, owed: int, per_step: bool | None) -> None:
        """After a load: make the ``owed`` steps."""
        ...


class RunState(Protocol):
    """What a run has and where it stands, as a checkpoint saves and restores it: the models
    as setup returned them, their optimizers, loaders and schedulers, the other objects with a
    state, the program's tracked state (name to object), and the counters a load sets."""

    global_step: int
    micro_step: int
    stepped_at: int
    oom_split: int

    @property
    def modules(self) -> Sequence[nn.Module]: ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...

    @property
    def loaders(self) -> Sequence[Loader]: ...

    @property
    def schedulers(self) -> Sequence[Scheduler]: ...

    @property
    def objects(self) -> Sequence[Any]: ...

    @property
    def tracked(self) -> Mapping[str, Any]: ...


def user_model(module: nn.Module, strategy: Unwraps, precision: Unwraps) -> nn.Module:
    """The user's own model inside what ``setup`` returned: the strategy's wrapper (DDP, dp)
    holds the precision's (autocast), which holds the model. Its keys are the checkpoint's."""
    return precision.unwrap(strategy.unwrap(module))
