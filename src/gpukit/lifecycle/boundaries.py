"""What happens at the boundaries of a run, beside the step itself: the heartbeat gpukit's
launcher watches, injected faults, periodic checkpoints, resuming by itself, and stopping
cleanly when preempted.

At each boundary the Runtime owns (a step begins, a backward, the optimizer step, a step ends,
a save, a collective) :class:`Lifecycle` does a few Python operations and, once per step, one
memory write for the heartbeat: no collective, no read from the device. The exceptions are
named where they happen: a checkpoint (collective by nature), and with ``save_every`` given in
time, one small agreement every ``log_every`` steps (the ranks' clocks differ, so they must
agree on the step to save at), and after a preemption signal a store lookup per step until the
ranks agree where to stop. With a checkpoint folder, under several ranks, a watcher thread asks
the store every half second whether a rank was signalled, beside the steps, never on them (see
``gpukit.lifecycle.preemption``).

>>> parse_save_every("10m"), parse_save_every(4), parse_save_every("90s")
((None, 600.0), (4, None), (None, 90.0))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gpukit import _env
from gpukit._util import placement
from gpukit.checkpoint import files
from gpukit.checkpoint import lock as folder_lock
from gpukit.errors import Preempted, warn_user
from gpukit.launch.faults import FaultPlan
from gpukit.launch.heartbeat import Heartbeat
from gpukit.lifecycle.checks import LifecycleSettings, parse_save_every
from gpukit.lifecycle.preemption import Preemption
from gpukit.lifecycle.watched import Handed, WatchedRank


class Lifecycle:
    """The boundaries of one rank's run (see the module docstring); it has the hooks the step
    calls at its boundaries (``gpukit.runtime.step.boundaries.StepBoundaries``).

    ``save`` writes a checkpoint (every rank calls it at the same step), given whether its
    files may be written in the background (``async_save``: a periodic one may, a stop's may
    not); ``settle`` waits for a checkpoint still being written, every rank together, before a
    stop and at the end; ``agree`` returns,
    for a list of flags, whether any rank set each (a collective); ``store`` gives the
    process group's store; ``resume`` resumes from the newest good checkpoint, if any (called
    once, before the first step or pass, with ``resume="auto"``)."""

    def __init__(
        self,
        config: LifecycleSettings,
        rank: int,
        world_size: int,
        log_every: int,
        save: Callable[[bool], Path],
        agree: Callable[[list[bool]], list[bool]],
        store: Callable[[], Any],
        resume: Callable[[], Any],
        deferrable: Callable[[], bool] = lambda: False,
        settle: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        # A save a step end asks for waits for the next boundary while a set-up loader's pass
        # is under way (its next batch), so that it holds what the program did after the step.
        self._deferrable = deferrable
        self._pending: tuple[str, int] | None = None  # ("save" or "stop", the step)
        self.rank, self.world_size, self.log_every = rank, world_size, log_every
        self._save, self._agree, self._resume = save, agree, resume
        self._settle = settle
        self.every_steps, self.every_seconds = parse_save_every(config.save_every)
        self.lock: folder_lock.FolderLock | None = None
        if config.checkpoints is not None and rank == 0:  # one run per folder: refused now
            self.lock = folder_lock.hold(
                config.checkpoints,
                command=folder_lock.this_program(),
                fix="wait for it, stop it, or give this run another checkpoints folder",
            )
        self.heartbeat = Heartbeat.from_env()
        self.watched: WatchedRank | None = None  # the heartbeat's figures (see watch)
        self.faults = FaultPlan.from_env(rank)
        self.preemption: Preemption | None = None
        if config.checkpoints is not None:
            place = placement.launched()
            # One rank per machine asks its torchrun agent to stop (the agent would take a
            # second signal while it stops its ranks as an error of its own).
            local_first = place is None or place.local_rank == 0
            self.preemption = Preemption(
                rank,
                world_size,
                store,
                self.heartbeat,
                _env.restart_count(),
                agent=_env.torchrun_agent() if local_first else None,
                newest=lambda: self.saved_step,
                writing=lambda: self.in_flight,
            )
        self._last_save = time.monotonic()
        self.saved_step = -1  # the step of the last checkpoint in place: written or loaded
        self.writing_step: int | None = None  # a save's step written in the background
        self._made_step = -1  # the step of the last save or load, the same on every rank
        self.resumed = config.resume != "auto"  # True once there is nothing left to resume
        self._watching: list[RemovableHandle] = []  # set-up models' first-forward hooks
        self.beat("start", 0)

    @property
    def folder(self) -> Path | None:
        return Path(self.config.checkpoints) if self.config.checkpoints is not None else None

    def beat(self, phase: str, step: int) -> None:
        """This rank entered ``phase`` at ``step``: one memory write when a launcher watches."""
        if self.heartbeat is not None:
            self.heartbeat.beat(phase, step)

    def watch(
        self, device: torch.device, accumulate: int, heartbeat: Heartbeat | None = None
    ) -> None:
        """When a launcher watches this rank: its heartbeat carries ``device``'s memory and,
        from the set-up loaders (:meth:`loader_hooks`), its data phase and the samples a step
        takes (``accumulate`` batches). Nothing otherwise. ``heartbeat``: one to write in
        place of the launcher's (``gpukit bench overhead`` times the beats without a job);
        given before the first loader is set up."""
        if heartbeat is not None:
            self.heartbeat = heartbeat
        if self.heartbeat is not None:
            self.watched = WatchedRank(self.heartbeat, device, accumulate)

    def loader_hooks(self, handed: Handed) -> tuple[Callable[[], None], Handed]:
        """A set-up loader's ``on_batch`` (:meth:`at_boundary`) and ``on_handed``
        (``handed``), each beating too when a launcher watches (``gpukit.lifecycle.watched``)."""
        if self.watched is None:
            return self.at_boundary, handed
        return self.watched.loader_hooks(self.at_boundary, handed)

    def before_first_pass(self) -> Any:
        """A loader's pass or a step is about to start: resume first, once (``"auto"``).
        Returns what the resume returned (the checkpoint's epoch and step, None without one)."""
        self._stop_watching()
        if self.resumed:
            return None
        self.resumed = True
        return self._resume()

    def resume_before_forward(self, module: nn.Module) -> None:
        """Resume (``"auto"``), if not done by then, before ``module``'s first forward: a loop
        that reads its batches itself calls the model before anything else the Runtime sees,
        and that forward must run on the resumed weights. The hook goes first (before fsdp's
        own, which gathers the weights) and is removed from every model at the resume."""
        if not self.resumed:
            hook = torch.compiler.disable(self._at_first_forward)  # loads, gathers: eager
            self._watching.append(module.register_forward_pre_hook(hook, prepend=True))

    def _at_first_forward(self, module: nn.Module, args: Any) -> None:
        progress = self.before_first_pass()
        if progress is not None and progress["step"] > 0:
            warn_user(
                f"resumed at step {progress['step']} at the first forward of a set-up model: "
                "whatever this program chose before that call (its batch, by rt.global_step "
                "or from the random generators) was chosen as a new run would choose it. Call "
                "rt.resume() right after rt.setup(...), or read batches from a loader set up "
                "with rt.setup, so that the run resumes before the loop starts"
            )

    def _stop_watching(self) -> None:
        for handle in self._watching:
            handle.remove()
        self._watching.clear()

    def step_begins(self, step: int, forward: bool = True) -> None:
        """Optimizer step ``step + 1`` begins (``step`` taken so far): a save still pending
        from the last step is made now, before this step's forward (a loop that reads no
        batch from a set-up loader in between). ``forward``: its forward starts now (else it
        has run already: rt.backward's first call of a step); beaten unless a set-up
        loader's batch, handed, began it."""
        self.at_boundary()
        if self.preemption is not None and not self.preemption.installed:
            self.preemption.install()  # from the first step on: before it, nothing to save
        heartbeat = self.heartbeat
        if forward and heartbeat is not None and heartbeat.phase != "forward":
            heartbeat.beat("forward", step)
        self.faults.step_begins(step + 1)

    def poison_loss(self) -> bool:
        return self.faults.nan_now

    def save_made(self, step: int, *, in_place: bool, own_write: bool = True) -> None:
        """A checkpoint at ``step`` was made (saved, or loaded): a periodic save pending for
        that step is made by it, and the interval of ``save_every`` counts from now. It is
        ``in_place`` (a synchronous save, a load), or else being written in the background
        until :meth:`landed` or :meth:`settled` says how that ended; ``own_write``: this
        rank's thread writes a part of it (else its part is done)."""
        self._last_save = time.monotonic()
        self._made_step = step
        if self._pending == ("save", step):
            self._pending = None
        if in_place:
            self.saved(step)
            return
        self.writing_step = step
        if not own_write and self.heartbeat is not None:
            # Rank 0 writes (whole weights): this rank's part is done. The launcher takes the
            # smallest saved step over the ranks: rank 0's, once its write lands.
            self.heartbeat.saved(step)

    def saved(self, step: int) -> None:
        """The checkpoint at ``step`` is in place (written, or loaded)."""
        self.saved_step = step
        if self.heartbeat is not None:
            self.heartbeat.saved(step)

    def landed(self, step: int) -> None:
        """The background write of ``step`` ended on this rank's thread (rank 0): attributes
        only, on that thread; the heartbeat records it with the next beat (one writer)."""
        if step > self.saved_step:  # a write given up at a stop may end after a later save
            self.saved_step = step
            if self.heartbeat is not None:
                self.heartbeat.saved_step = step

    def settled(self, landed: bool) -> None:
        """The ranks agreed on the background write in flight: whether it ``landed``."""
        step, self.writing_step = self.writing_step, None
        if landed and step is not None:
            self.saved(step)
        elif step == self._made_step:  # given up: that step has no checkpoint after all
            self._made_step = -1

    @property
    def in_flight(self) -> int | None:
        """The step of the checkpoint being written in the background, if any, not yet in
        place."""
        step = self.writing_step
        return step if step is not None and step != self.saved_step else None

    def made(self, step: int) -> bool:
        """The last save or load was of ``step`` (in place or being written): the same on
        every rank, where ``saved_step`` is not (rank 0's thread tells it first)."""
        return step == self._made_step

    def step_ended(self, step: int) -> None:
        """After optimizer step ``step``: a periodic checkpoint when one is due, and the
        preemption's save and stop when a signal asked for it, made at the next boundary
        between steps (see :meth:`at_boundary`)."""
        if self.watched is not None:
            self.watched.step_ends()
        self.beat("loop", step)
        preempt = self.preemption
        if preempt is not None and preempt.should_stop(step):
            self._pending = ("stop", step)
        elif self._due(step):
            self._pending = ("save", step)
        if self._pending is not None and not self._deferrable():
            self.at_boundary()  # no loader pass to wait for: the step's end is the boundary

    def at_boundary(self) -> None:
        """Between two steps, once the program has done what it does after a step (its
        scheduler call, the values it tracks, its own random draws) and before the next batch
        is read: make the save a step end left pending, and stop there if a preemption asked.
        A set-up loader calls it before each batch; the next step's start calls it too. One
        flag read when nothing is pending."""
        if self._pending is None:
            return
        (kind, step), self._pending = self._pending, None
        preempt = self.preemption
        if kind == "stop" and preempt is not None:
            preempt.saving()
        if self.made(step) and self.folder is not None:
            path = self.folder / files.folder_name(step)  # the program saved it itself
        else:
            path = self._save(kind == "save")  # a stop's save is written before it stops
        if kind == "save":
            return
        assert preempt is not None
        self._settle()  # the program's own save of this step may still be being written
        preempt.leave_together()
        if self.saved_step == step:
            saved = f"saved {path}"
        else:  # that write was given up at the end of the grace: the newest is older
            newest = self.saved_step
            older = (
                f"the newest checkpoint is {path.with_name(files.folder_name(newest))}"
                if newest >= 0
                else "no checkpoint was saved"
            )
            saved = (
                f"the checkpoint of step {step} was still being written at the end of the "
                f"grace period and is not saved ({older})"
            )
        stop = Preempted(
            f"{preempt.requested}: stopped after step {step} on every rank and "
            f"{saved}. Resume with `gpukit train ... --resume` (same --out), or "
            f"gk.Runtime(checkpoints={str(self.folder)!r}, resume='auto')"
        )
        # Said once: by rank 0, or by gpukit's launcher, which reads it from rank 0's record.
        if self.rank == 0 and _env.job_dir() is None:
            print(f"gpukit: {stop}", file=sys.stderr, flush=True)
        raise stop

    def _due(self, step: int) -> bool:
        if self.every_steps is not None:
            return step % self.every_steps == 0
        if self.every_seconds is None or step % self.log_every:
            return False
        late = time.monotonic() - self._last_save >= self.every_seconds
        if self.world_size == 1:
            return late
        return self._agree([late])[0]  # every log_every steps: the ranks' clocks differ

    def finished(self, step: int) -> None:
        """The rank's work returned normally (a failure keeps the phase it failed in): a save
        still pending is made (every rank is here), without stopping: the work is done."""
        if self._pending is not None:
            self._pending = ("save", self._pending[1])  # the work is done: no stop, a save
            self.at_boundary()
        self._settle()  # every rank is here: a checkpoint still being written finishes
        self.beat("end", step)

    def close(self) -> None:
        """Give the signal handlers, the checkpoints folder and the models' hooks back."""
        self._stop_watching()
        if self.preemption is not None:
            self.preemption.uninstall()
        if self.lock is not None:
            self.lock.release()
            self.lock = None
