"""What ``rt.setup`` and ``rt.track`` are given besides the model: each object is registered
for checkpoints, or refused there and then, never dropped later.

``rt.setup(model, *objects)`` takes optimizers, learning-rate schedulers, DataLoaders and any
object with ``state_dict``/``load_state_dict`` (a gradient scaler, an EMA), alone or in lists,
tuples and dicts, and returns them in the same shape: DataLoaders wrapped, schedulers wrapped
(see ``gpukit.runtime.schedulers``), the rest as given. ``rt.track(**objects)`` takes the
program's own state: objects with ``state_dict``/``load_state_dict``, or dicts of numbers,
strings, lists and tensors, which a load fills in place.

What is saved must read back as plain data (``state.pt`` is loaded with ``weights_only=True``,
so a checkpoint never runs code): :func:`~gpukit.checkpoint.plain.not_plain` finds what would
not.

>>> not_plain({"best": 0.5, "history": [1, 2]}), not_plain({"fn": len})
(None, "['fn'] is a builtin_function_or_method")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from gpukit._util.text import described, type_name
from gpukit.checkpoint.plain import not_plain, saved_state
from gpukit.errors import ConfigError
from gpukit.runtime.data.dealing import data_order
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.schedulers import Scheduler, is_scheduler
from gpukit.runtime.settings import Settings
from gpukit.runtime.state import TrainState


class Registry:
    """The Runtime's ``rt.track``, and the wrapper its ``setup`` gives a scheduler: what it
    registers goes into ``state``; ``settings`` say how schedulers step."""

    def __init__(self, settings: Settings, state: TrainState) -> None:
        self.settings, self.state = settings, state

    def track(self, /, **objects: Any) -> None:
        """Save the program's own state in every checkpoint, with the rest of it (atomically),
        and restore it in place on load: objects with ``state_dict``/``load_state_dict``, or
        dicts of numbers, strings, lists and tensors. What a checkpoint cannot hold is refused
        here. Rank 0's values are saved, and every rank gets them back.

        >>> import gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> stats = {"best": float("inf"), "patience": 0}
        >>> rt.track(stats=stats)
        """
        track(self.state, objects)

    def scheduler(self, scheduler: Any, shards: int) -> Scheduler:
        """``scheduler`` as ``rt.setup`` returns it, for ``shards`` ranks sharing the loaders'
        batches: under ``scheduler_steps="per-sample"`` it steps once per loader batch that
        one optimizer step covers (``shards`` of them, or one where each rank takes a piece
        of every batch: :meth:`~gpukit.runtime.data.dealing.DataOrder.batches_per_step`)."""
        per_sample = self.settings.scheduler_steps == "per-sample"
        batches = data_order(self.settings, None).batches_per_step(shards)
        return Scheduler(scheduler, batches if per_sample else 1, self._mid_window)

    def _mid_window(self) -> bool:
        """Whether gradients are accumulating (the optimizer steps at the window's end)."""
        return self.state.micro_step % self.settings.accumulate != 0


def optimizers_in(objects: tuple[Any, ...]) -> list[torch.optim.Optimizer]:
    """The optimizers among ``objects``, inside lists, tuples and dicts too."""
    found: list[torch.optim.Optimizer] = []
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            found.append(obj)
        elif type(obj) in (list, tuple):
            found += optimizers_in(tuple(obj))
        elif type(obj) is dict:
            found += optimizers_in(tuple(obj.values()))
    return list({id(o): o for o in found}.values())  # once each, in order


def take_all(
    objects: tuple[Any, ...],
    state: TrainState,
    setup_loader: Callable[[DataLoader[Any]], DeviceLoader],
    make_scheduler: Callable[[Any], Scheduler],
    first: int = 2,
) -> list[Any]:
    """``rt.setup``'s arguments after the model (the first of them its argument ``first``),
    as it returns them (see :func:`take`)."""
    args = (state, setup_loader, make_scheduler)
    return [take(o, f"argument {i + first}", *args) for i, o in enumerate(objects)]


def take(
    obj: Any,
    where: str,
    state: TrainState,
    setup_loader: Callable[[DataLoader[Any]], DeviceLoader],
    make_scheduler: Callable[[Any], Scheduler],
) -> Any:
    """``obj`` (argument ``where`` of ``rt.setup``) as ``setup`` returns it, registered."""
    if type(obj) in (list, tuple):
        args = (state, setup_loader, make_scheduler)
        return type(obj)(take(o, f"{where}[{i}]", *args) for i, o in enumerate(obj))
    if type(obj) is dict:
        args = (state, setup_loader, make_scheduler)
        return {k: take(v, f"{where}[{k!r}]", *args) for k, v in obj.items()}
    if obj is None or isinstance(obj, torch.optim.Optimizer):
        return obj  # optimizers: registered before the model was placed
    if isinstance(obj, DataLoader):
        return setup_loader(obj)
    if isinstance(obj, (DeviceLoader, Scheduler)):
        return obj  # what an earlier setup returned
    if is_scheduler(obj):
        known = next((s for s in state.schedulers if s.scheduler is obj), None)
        if known is None:
            check_saveable(f"rt.setup: {where}", obj)
            known = make_scheduler(obj)
            state.schedulers.append(known)
        return known
    if isinstance(obj, nn.Module):
        raise ConfigError(
            f"rt.setup got a second model, {type_name(obj)}, as {where}: set up each model "
            "with its own call (model_b = rt.setup(model_b)), and a loss module with "
            "rt.setup_criterion(loss)"
        )
    if not _stateful(obj):
        raise ConfigError(
            f"rt.setup got {described(obj)} as {where}, which a checkpoint cannot hold: pass "
            "optimizers, learning-rate schedulers, DataLoaders and objects with state_dict() "
            "and load_state_dict() (in lists, tuples or dicts), and register your own values "
            "with rt.track(name=a_dict)"
        )
    if not any(o is obj for o in state.objects):
        check_saveable(f"rt.setup: {where}", obj)
        state.objects.append(obj)
    return obj


def track(state: TrainState, objects: dict[str, Any]) -> None:
    """Register ``objects`` (name to object) as the program's own state, checked now."""
    if not objects:
        raise ConfigError(
            "rt.track() got nothing: name what to save, e.g. rt.track(stats={'best': 0.0})"
        )
    for name, obj in objects.items():
        where = f"rt.track({name}=...)"
        if type(obj) is dict:
            problem = not_plain(obj)
            if problem is not None:
                raise ConfigError(
                    f"{where}: the dict's {problem}, which a checkpoint cannot hold as plain "
                    "data: keep numbers, strings, lists and tensors in it, or give an object "
                    "with state_dict() and load_state_dict()"
                )
        elif isinstance(obj, (DataLoader, DeviceLoader, torch.optim.Optimizer)) or is_scheduler(
            obj
        ):
            raise ConfigError(
                f"{where}: {type_name(obj)} is set up with rt.setup(model, ...), which saves it"
            )
        elif not _stateful(obj):
            kind = "a dict" if isinstance(obj, (int, float, str, list)) else "an object"
            raise ConfigError(
                f"{where}: {described(obj)} cannot be restored in place; give a dict "
                f"(rt.track({name}={{'value': ...}})), which a load fills in place, or {kind} "
                "with state_dict() and load_state_dict()"
            )
        else:
            check_saveable(where, obj)
        known = state.tracked.get(name)
        if known is not None and known is not obj:
            raise ConfigError(
                f"{where}: the name {name!r} is already tracked for another "
                f"{type_name(known)}: give each tracked object its own name"
            )
        state.tracked[name] = obj


def check_saveable(where: str, obj: Any) -> None:
    """ConfigError unless ``obj.state_dict()`` is plain data."""
    try:
        saved = saved_state(obj)
    except Exception as err:
        raise ConfigError(
            f"{where}: {type_name(obj)}.state_dict() failed ({type(err).__name__}: {err}), so "
            "it cannot be checkpointed"
        ) from err
    problem = not_plain(saved)
    if problem is not None:
        raise ConfigError(
            f"{where}: {type_name(obj)}.state_dict()'s {problem}, which a checkpoint cannot "
            "hold as plain data (checkpoints load with weights_only=True and never run code). "
            "Keep only numbers, strings, lists, dicts and tensors in its state (a LambdaLR "
            "with plain functions saves none of them; one with callable objects saves "
            "their attributes)"
        )


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )
