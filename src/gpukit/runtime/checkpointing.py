"""The Runtime's checkpoints: ``rt.save``, ``rt.load``, ``rt.resume`` and ``rt.full_state_dict``.

What they save and how is :mod:`gpukit.checkpoint`; here is what the Runtime adds around it:
the folder it defaults to, the heartbeat's phase, the check that every rank calls, the logging
window closed before a save, what a load tells the lifecycle and the step, and, with
``async_save``, the write in flight: each save, load and the end of the run first settles it
(waits for it, and raises its failure on every rank; see ``gpukit.checkpoint.background``).

>>> import tempfile, torch, gpukit as gk
>>> rt = gk.Runtime(devices="cpu")
>>> model = rt.setup(torch.nn.Linear(2, 1))
>>> folder = tempfile.mkdtemp()
>>> rt.save(folder).name, rt.load(folder)
('step-00000000', {'epoch': 0, 'step': 0})

Beside the folder, the file form of a Fabric program: ``rt.save("run.pt", state)`` and
``rt.load("run.pt", state)`` (see :mod:`gpukit.checkpoint.state_file`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpukit import _env, checkpoint
from gpukit.checkpoint import pretrained, state_file
from gpukit.checkpoint.background import Background
from gpukit.checkpoint.live import user_model
from gpukit.errors import ConfigError
from gpukit.lifecycle.boundaries import Lifecycle
from gpukit.runtime.settings import Settings
from gpukit.runtime.state import TrainState
from gpukit.runtime.step.precision import Precision
from gpukit.runtime.step.stepper import Stepper
from gpukit.strategies import Strategy


@dataclass(frozen=True)
class RuntimeCalls:
    """What the Runtime does around a checkpoint: ``ready`` joins its process group,
    ``close_window`` reads back the pending logging window (collective: only where every rank
    is), ``say`` prints on rank 0."""

    ready: Callable[[], None]
    close_window: Callable[[], None]
    say: Callable[[str], None]


class Checkpointing:
    """The checkpoint methods of :class:`~gpukit.Runtime`: ``state`` (what ``setup`` saw and
    the step) under ``strategy`` and ``precision``, saved and restored where ``lifecycle``'s
    folder is, with the ``accumulate``, ``keep`` and ``export`` of ``settings``; a load tells
    ``stepper`` the restored step. The Runtime gives this part the new strategy and stepper
    when ``strategy="auto"`` replaces them."""

    def __init__(
        self,
        settings: Settings,
        state: TrainState,
        strategy: Strategy,
        precision: Precision,
        lifecycle: Lifecycle,
        stepper: Stepper,
        runtime: RuntimeCalls,
    ) -> None:
        self.settings, self.state, self.strategy = settings, state, strategy
        self.precision, self.lifecycle, self.stepper = precision, lifecycle, stepper
        self.runtime = runtime
        # The write in flight (async_save), if any; its thread tells the lifecycle it landed.
        self.background = Background(landed=lifecycle.landed)
        # A save written in the background since the last settle, on every rank alike (saves
        # are collective): only then do the ranks meet to settle it.
        self._unsettled = False
        self._stop_seen: float | None = None  # when a wait first saw a stop asked for

    def save(
        self,
        path: str | Path | None = None,
        state: Mapping[str, Any] | None = None,
        keep: int | None = None,
        *,
        export: bool | None = None,
    ) -> Path:
        """Write a checkpoint of everything ``setup`` saw (see ``gpukit.checkpoint``)
        into the folder ``path`` (default: the Runtime's ``checkpoints``), keeping the newest
        ``keep`` (default: the Runtime's ``keep``); returns the checkpoint's folder.

        Given a ``state`` dict, writes that alone to the file ``path`` instead, as Fabric's
        ``fabric.save(path, state)`` does (see ``gpukit.checkpoint.state_file``): models,
        optimizers and schedulers as their full state dicts, tensors and plain values as they
        are; returns ``path``. A path named as a file (``.pt``, ``.pth``, ``.ckpt``, ``.bin``,
        ``.tar``) without a state, or a ``state`` with ``keep``/``export`` or for an existing
        folder, is refused: which one was meant cannot be told.

        Collective: every rank calls it (rank 0 writes the files, every rank gives its random
        state and, under fsdp, writes its shards). Called on some ranks only, it fails within
        30 s naming the ranks that did not call it. Under fsdp ``export`` (default: the
        Runtime's ``export`` setting) says whether it also holds the full weights.

        With ``async_save`` it returns once the files' contents are copied to host memory, and
        a thread writes them (under fsdp a thread on every rank writes its shards; see
        ``gpukit.checkpoint.background``)."""
        if state is not None or (path is not None and _file_named(path)):
            return self._save_file(path, state, keep, export)
        return self.save_now(path, keep, export=export, background=self.settings.async_save)

    def save_now(
        self,
        directory: str | Path | None = None,
        keep: int | None = None,
        *,
        export: bool | None = None,
        background: bool = False,
    ) -> Path:
        """:meth:`save`, written by a thread when ``background`` (a preemption's save is
        not)."""
        self.runtime.ready()
        folder = checkpoint.folder("rt.save", directory, self.lifecycle.folder)
        if folder.is_file():
            raise ConfigError(
                f"rt.save({str(folder)!r}): that is a file; give a folder, or "
                f"rt.save({str(folder)!r}, state) to write a dict of your own to the file"
            )
        self.lifecycle.beat("save", self.state.global_step)
        self.strategy.check_every_rank_calls("rt.save")
        self.runtime.close_window()
        self.settle("this save")  # one write in flight at most: the one before finishes first
        background = background and not self.background.gave_up  # (see Background.gave_up)
        path = checkpoint.save(
            Path(folder),
            self.state,
            self.strategy,
            self.precision,
            accumulate=self.settings.accumulate,
            keep=keep if keep is not None else self.settings.keep,
            export=export if export is not None else self.settings.export == "every",
            background=self.background if background else None,
        )
        self._unsettled = background
        self.lifecycle.save_made(
            self.state.global_step,
            in_place=not background,
            # Whether this rank writes too (rank 0; every rank under fsdp), or is done.
            own_write=self.background.step is not None,
        )
        return path

    def load(
        self, path: str | Path | None = None, state: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Restore the newest checkpoint under the folder ``path`` (default:
        ``checkpoints``); returns ``{"epoch", "step"}``: the step, and the passes the first
        loader ``setup`` saw had run to their end (0 without one), which is also the 0-based
        index of the pass a resumed loop is in (the pass a save was made in, continued from its
        position; the next one after a save at a pass's end): ``for epoch in
        range(progress["epoch"], epochs)``. Nothing changes unless everything in it matches.

        Given a file (what ``rt.save(path, state)`` wrote), reads it on every rank as Fabric's
        ``fabric.load`` does: without ``state``, returns its dict; with a ``state`` dict, loads
        its models, optimizers and schedulers in place, replaces its other values with the
        file's, and returns the file's items that ``state`` does not name."""
        if state is not None or (path is not None and Path(path).is_file()):
            return self._load_file(path, state)
        if path is not None and _file_named(path) and not Path(path).is_dir():
            raise ConfigError(
                f"rt.load({str(path)!r}): no such file (a checkpoint folder is named without a "
                "suffix): give the file rt.save(path, state) wrote"
            )
        self.runtime.ready()
        folder = checkpoint.folder("rt.load", path, self.lifecycle.folder)
        self.lifecycle.beat("load", self.state.global_step)
        self.settle("this load")  # the checkpoint being written may be the one to load
        self.lifecycle.resumed = True  # an explicit load is the resume
        progress = checkpoint.load(
            folder, self.state, self.strategy, self.precision, self.settings.accumulate
        )
        self.stepper.sync_next_backward()  # the DDP sync flag must follow the restored step
        self._weights_replaced()
        self.lifecycle.beat("load", self.state.global_step)  # where this attempt starts
        self.lifecycle.save_made(self.state.global_step, in_place=True)
        return progress

    def _save_file(
        self,
        path: str | Path | None,
        state: Mapping[str, Any] | None,
        keep: int | None,
        export: bool | None,
    ) -> Path:
        """``rt.save(path, state)``: the file form, its ambiguous calls refused first."""
        shown = f"{str(path)!r}" if path is not None else "None"
        if state is None:
            raise ConfigError(
                f"rt.save({shown}) without a state: a name with a file suffix is the file "
                f"form, which writes what it is given: rt.save({shown}, {{'model': model, "
                "'optimizer': optimizer}); for a checkpoint folder, name it without a suffix"
            )
        if path is None or not str(path).strip():
            raise ConfigError(
                "rt.save(state=...) needs the file to write: rt.save('run.pt', state)"
            )
        if keep is not None or export is not None:
            raise ConfigError(
                f"rt.save({shown}, state, keep=..., export=...): keep and export are for a "
                "checkpoint folder (rt.save(folder)); the file form writes one file: leave "
                "them out"
            )
        target = Path(path)
        if target.is_dir():
            raise ConfigError(
                f"rt.save({shown}, state): that is a folder; the file form writes one file: "
                f"give a file name (e.g. {str(target / 'run.pt')!r}), or rt.save({shown}) "
                "without a state for a checkpoint folder"
            )
        self.runtime.ready()
        self.lifecycle.beat("save", self.state.global_step)
        self.strategy.check_every_rank_calls("rt.save")
        self.runtime.close_window()
        self.settle("this save")
        state_file.save(target, state, self._run())
        return target

    def _load_file(
        self, path: str | Path | None, state: Mapping[str, Any] | None
    ) -> dict[str, Any]:
        """``rt.load(path, state)``: the file form, its ambiguous calls refused first."""
        if path is None or not str(path).strip():
            raise ConfigError("rt.load(state=...) needs the file to read: rt.load('run.pt', state)")
        target = Path(path)
        if target.is_dir():
            raise ConfigError(
                f"rt.load({str(path)!r}, state): that is a checkpoint folder, which restores "
                f"everything rt.setup saw by itself: rt.load({str(path)!r}); a state is for "
                "the file rt.save(path, state) wrote"
            )
        self.runtime.ready()
        self.lifecycle.beat("load", self.state.global_step)
        self.settle("this load")  # a file may be read while a folder is written: one at a time
        self.strategy.check_every_rank_calls("rt.load")
        found = state_file.load(target, state, self._run())
        self._weights_replaced()
        return found

    def _run(self) -> state_file.Run:
        return state_file.Run(self.state, self.strategy, self.precision)

    def load_weights(
        self, path: str | Path, model: nn.Module | None = None, *, strict: bool = True
    ) -> dict[str, Any]:
        """Fill the weights of ``model`` (default: the one model ``setup`` saw) from
        safetensors files: a ``.safetensors`` file, or a folder of them (Hugging Face's
        ``save_pretrained`` layout with its index, or gpukit's exports). Under fsdp each rank
        reads only its shards' rows, so a model built on the meta device is never whole on a
        rank. Names and shapes are checked before anything changes; ``strict=False`` loads
        the names both have. Returns ``{"loaded", "files", "missing", "unexpected"}``.

        >>> import torch, gpukit as gk, tempfile, safetensors.torch as st
        >>> rt = gk.Runtime(devices="cpu")
        >>> model = rt.setup(torch.nn.Linear(2, 1))
        >>> folder = tempfile.mkdtemp()
        >>> weights = {"weight": torch.ones(1, 2), "bias": torch.zeros(1)}
        >>> st.save_file(weights, folder + "/m.safetensors")
        >>> rt.load_weights(folder)["loaded"], model.weight.tolist()
        (2, [[1.0, 1.0]])
        """
        self.runtime.ready()
        if model is None:
            if len(self.state.modules) != 1:
                raise ConfigError(
                    f"rt.load_weights without a model needs exactly one model set up, and "
                    f"setup saw {len(self.state.modules)}: pass it, rt.load_weights(path, model)"
                )
            model = self.state.modules[0]
        loaded = pretrained.load_weights(
            user_model(model, self.strategy, self.precision), path, strict=strict
        )
        self._weights_replaced()
        return loaded

    def _weights_replaced(self) -> None:
        # What the strategy prepares from the weights after each optimizer step (fsdp's
        # float8 scales) must follow loaded weights too, or the next forward would use the
        # scales of the weights the load replaced.
        for module in self.state.modules:
            self.strategy.after_optimizer_step(module)

    def full_state_dict(self, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The full weights of ``model`` (default: the one model ``setup`` saw) as plain CPU
        tensors on rank 0, ``{}`` on the other ranks; under fsdp gathered from every rank's
        shards. Collective: every rank calls it.

        >>> import torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> sorted(rt.full_state_dict(rt.setup(torch.nn.Linear(2, 1))))
        ['bias', 'weight']
        """
        self.runtime.ready()
        self.strategy.check_every_rank_calls("rt.full_state_dict")
        return checkpoint.full_state_dict(model, self.state, self.strategy, self.precision)

    def wait_for_save(self) -> float:
        """Wait until the checkpoint being written in the background (``async_save``), if
        any, is in place; returns the seconds waited. This rank only, no collective: a write
        that failed is raised, on every rank, at the next save, load or the end of the run.

        >>> import gpukit as gk
        >>> gk.Runtime(devices="cpu").wait_for_save()
        0.0
        """
        return self.background.wait()

    def settle(self, why: str) -> None:
        """Collective: wait for the write in flight, if any, and raise its failure on every
        rank. Once a stop was asked for (SIGTERM), within half of ``GPUKIT_STOP_GRACE`` (the
        stop's own save gets the rest), saying which step was not saved when it cannot finish
        in time. Nothing at all (no collective)
        when no save was written in the background since the last settle."""
        if not self._unsettled:
            return
        self._unsettled = False
        landed = self.background.settle(self.strategy, self.runtime.say, why, self._deadline)
        self.lifecycle.settled(landed)  # the step counts as saved once its write landed

    def _deadline(self) -> float | None:
        """Until when a write in flight is waited for: without limit, but once a stop was
        asked for, half the stop's grace from when the wait saw it."""
        preemption = self.lifecycle.preemption
        if preemption is None or preemption.requested is None:
            return None
        if self._stop_seen is None:
            self._stop_seen = time.monotonic()
        return self._stop_seen + _env.stop_grace() / 2

    def end(self, failing: bool) -> None:
        """The run ends (``rt.teardown``): settle the write in flight, every rank together,
        and free the host copies kept for the next save. While an error ends it (``failing``:
        the ranks may not all be here) only this rank waits (within half the stop grace when
        a stop was asked for) and says a failed write."""
        try:
            if not failing:
                self.settle("the end of the run")
                return
            self._unsettled = False
            try:
                landed = self.background.settle(
                    _Alone(), self.runtime.say, "the end of the run", self._deadline
                )
                self.lifecycle.settled(landed)
            except Exception as err:  # the error already ending the run goes on; said here
                self.runtime.say(f"gpukit: {err}")
        finally:
            self.background.free()  # the host copies kept for the next save: none comes

    def resume(self) -> dict[str, int] | None:
        """Continue from the newest good checkpoint in ``checkpoints`` (its epoch and step),
        else None. ``resume="auto"`` calls it by itself before the first pass, step or forward."""
        self.lifecycle.resumed = True
        folder = self.lifecycle.folder
        found = checkpoint.resumable(folder) if folder is not None else None
        if found is None:
            return None
        progress = self.load(found)  # the one found: looking again would warn again
        self.runtime.say(f"gpukit: resumed from {folder} at step {progress['step']}")
        return progress


def _file_named(path: str | Path) -> bool:
    """Whether ``path`` names a file of the file form rather than a checkpoint folder: it
    ends in a file's suffix and no folder stands there (an existing folder so named stays a
    folder)."""
    return state_file.named_as_file(path) and not Path(path).is_dir()


class _Alone:
    """A world of this rank alone: what ``Background.settle`` agrees with when the other
    ranks may not be there."""

    rank = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return obj
