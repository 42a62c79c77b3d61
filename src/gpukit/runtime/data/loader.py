"""A device-aware wrapper around a DataLoader that iterates exactly like it.

What stays as with plain PyTorch: every ``iter()`` is its own pass, which draws from the
global random generator when it starts as a ``DataLoader`` does (the workers' base seed, and a
``RandomSampler``'s seed), so a program keeps its random stream; a peek
(``next(iter(loader))``) or a ``break`` never changes what the next ``for`` loop sees;
``len``, ``dataset``, ``batch_size``, ``sampler`` and the loader's other attributes are there.

What it adds: it shards the data across ranks (see ``gpukit.runtime.data.sampling``; or in
Accelerate's order, ``gpukit.runtime.data.dealing``), calls the
sampler's ``set_epoch`` at each pass (unless the program calls it itself; in Accelerate's order
the dataset's too, where Accelerate calls it), leaves SIGTERM and
SIGINT to the main process in its workers (``workers.MainStops``: a preemption then saves),
hands out batches already on the device (``prefetch``: on CUDA from pinned memory, the next
batch copied on a side stream while the current one is used), measures how long each batch
was waited for (``wait``: ``data_wait`` in ``rt.history``), and remembers where the
training pass is, so a resumed run continues with the next batch and the same random numbers.

>>> import torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu")
>>> loader = rt.setup_loader(DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4))
>>> [batch[0].tolist() for batch in loader]
[[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
>>> len(loader), len(loader.dataset), loader.batch_size
(2, 8, 4)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from gpukit.errors import ConfigError
from gpukit.runtime.data import sampling
from gpukit.runtime.data.checks import check_has_batches
from gpukit.runtime.data.dealing import DataOrder, Dealt, dataset_told_epoch, dealt
from gpukit.runtime.data.prefetch import on_device
from gpukit.runtime.data.sampling import PassSampler
from gpukit.runtime.data.wait import DataWait
from gpukit.runtime.data.workers import MainStops

# The DataLoader arguments carried over when the loader is rebuilt around a new sampler.
_CARRIED = (
    "num_workers",
    "collate_fn",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


@dataclass(eq=False)  # passes are told apart by identity
class _Pass:
    """One ``iter()`` of the loader: how far it got, and the random state it started from."""

    steps_at_start: int
    rng: dict[str, Any]
    position: int = 0


@dataclass
class _Resume:
    """Where a checkpoint left the training pass, for the next pass to continue from."""

    position: int
    rng: dict[str, Any] | None = None


class DeviceLoader:
    """Iterate like the wrapped DataLoader; see the module docstring for what it adds.

    ``epoch`` counts finished passes and ``position`` the batches the training pass has handed
    out; both are saved in checkpoints. A pass run to its end is finished. A pass left early
    (``break``) after training steps in it is the training pass until the next ``iter()``
    starts a new one (so a checkpoint saved after the ``break`` continues it, as a run stopped
    at a step limit expects); then it counts as finished. A pass left without a training step
    (a peek) changes nothing. ``steps`` tells how many backward passes the run has taken;
    ``on_pass_end`` is called when a pass runs to its end, ``on_pass_start`` before each pass
    starts (where the Runtime resumes from a checkpoint, before the pass takes its position),
    ``on_batch`` before each batch is read (where a save the last step left pending is made),
    ``on_handed(loader, position, batch)`` after each batch is handed out (what evaluation's
    gathering reads: which loader, which batch of its pass). ``on_pass_end`` is told whether
    the pass trained (a backward pass ran during it) or evaluated. ``wait`` (the Runtime's
    meter, :class:`~gpukit.runtime.data.wait.DataWait`) is told how long each batch was
    waited for. ``order`` says how the ranks share the batches (its seed replaces ``seed``):
    gpukit's default, or Accelerate's (:mod:`gpukit.runtime.data.dealing`). ``local`` makes
    each batch on the device this rank's part of it (the strategy's ``local_batch``: under
    context parallelism, this rank's chunks of every sequence).
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        device: torch.device,
        num_shards: int,
        shard: int,
        seed: int = 0,
        steps: Callable[[], int] | None = None,
        on_pass_end: Callable[[bool], None] | None = None,
        on_pass_start: Callable[[], None] | None = None,
        on_batch: Callable[[], None] | None = None,
        on_handed: Callable[[DeviceLoader, int, Any], None] | None = None,
        wait: DataWait | None = None,
        order: DataOrder | None = None,
        local: Callable[[Any], Any] | None = None,
    ) -> None:
        self.device = device
        self._local = local
        self._order = order if order is not None else DataOrder(seed=seed)
        self._wait = wait
        self._on_batch = on_batch
        self._on_handed = on_handed
        self._on_pass_end = on_pass_end
        self._on_pass_start = on_pass_start
        self.original = loader
        self.epoch = 0
        self._steps = steps or (lambda: 0)
        self._live: list[_Pass] = []  # passes started and not yet finished, oldest first
        self._left: _Pass | None = None  # a training pass left early, until the next one starts
        self._resume: _Resume | None = None
        self._sampler: PassSampler | None = None
        self._unit = 1  # sampler items per batch: batch_size for an index sampler
        self._epoch_owned = True  # False once the program calls set_epoch itself
        self.loader = self._rebuilt(loader, num_shards, shard, self._order.seed)
        accelerate = self._order.name == "accelerate"
        self._told_epoch = dataset_told_epoch(loader, num_shards) if accelerate else None
        check_has_batches(loader, self.loader, num_shards)
        self._epoch_set = getattr(self.sampler, "epoch", None)

    # -- the loader actually iterated ------------------------------------------------------------
    def _rebuilt(
        self, loader: DataLoader[Any], num_shards: int, shard: int, seed: int
    ) -> DataLoader[Any]:
        accelerate = self._order.name == "accelerate" and num_shards > 1
        if isinstance(loader.dataset, IterableDataset):
            if accelerate:
                raise ConfigError(
                    "data_order='accelerate' deals a loader's batches to the ranks, but this "
                    "loader reads an IterableDataset, which has no batches to deal before it is "
                    "read: shard it in the dataset (torch.utils.data.get_worker_info, rt.rank) "
                    "and use data_order='torch'"
                )
            return loader  # an iterable dataset shards itself, if at all
        by_batch = loader.batch_sampler is not None and loader.batch_size is None
        chosen = loader.batch_sampler if by_batch else loader.sampler
        if accelerate:  # whole batches dealt, as Accelerate's prepare does
            chosen = dealt(loader, num_shards, shard, self._order)
            by_batch = loader.batch_sampler is not None
        elif num_shards > 1:
            if sampling.shards_by_rank(chosen):
                sampling.check_rank_sampler(chosen, num_shards, shard)
            elif not by_batch and sampling.is_plain_shuffle(chosen):
                chosen = sampling.distributed(loader, num_shards, shard, seed)
            else:
                chosen = sampling.Strided(chosen, num_shards, shard, drop_last=False)
        self._sampler = PassSampler(chosen)
        self._unit = 1 if by_batch else int(loader.batch_size or 1)
        options = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
        if options["num_workers"] == 0:
            options.pop("persistent_workers")
        else:
            options["worker_init_fn"] = MainStops(options["worker_init_fn"])
        if loader.prefetch_factor is not None and options["num_workers"] > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        pin = loader.pin_memory or self.device.type == "cuda"
        if by_batch:
            return DataLoader(
                loader.dataset, batch_sampler=self._sampler, pin_memory=pin, **options
            )
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=self._sampler,
            drop_last=loader.drop_last,
            pin_memory=pin,
            **options,
        )

    @property
    def sampler(self) -> Any:
        """The sampler passes draw from: the user's own, or the one sharding it across ranks
        (a ``DistributedSampler`` for a plain shuffle). None for an iterable dataset."""
        return self._sampler.inner if self._sampler is not None else None

    @property
    def dataset(self) -> Any:
        return self.original.dataset

    @property
    def batch_size(self) -> int | None:
        return self.original.batch_size

    def __getattr__(self, name: str) -> Any:
        # Everything else a DataLoader has (drop_last, num_workers, collate_fn, ...) is the
        # user's loader's own. Private names are not forwarded: they are this object's.
        if name.startswith("_") or name in {"original", "loader"}:
            raise AttributeError(name)
        return getattr(self.original, name)

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def in_pass(self) -> bool:
        """A pass is under way: its next batch will be asked for."""
        return bool(self._live)

    # -- progress ------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Batches handed out by the newest unfinished pass (or waiting to be skipped by the
        next one, after a checkpoint was loaded)."""
        if self._live:
            return self._live[-1].position
        if self._left is not None:
            return self._left.position
        return self._resume.position if self._resume is not None else 0

    @position.setter
    def position(self, value: int) -> None:
        self._left, self._resume = None, (_Resume(value) if value else None)

    def state_dict(self) -> dict[str, Any]:
        """Progress for a checkpoint: ``epoch``, ``position``, ``batch_size``."""
        return {"epoch": self.epoch, "position": self.position, "batch_size": self.batch_size}

    def pass_rng(self) -> dict[str, Any] | None:
        """The random state the training pass started from (this process's own), which a
        resumed run needs to redo that start's draws; None between passes."""
        if self._live:
            return self._live[-1].rng
        if self._left is not None:
            return self._left.rng
        return self._resume.rng if self._resume is not None else None

    def generator_states(self) -> list[torch.Tensor]:
        """The state now of each private generator the loader's passes draw from (a
        ``DataLoader(generator=...)``'s, a sampler's own): between passes it is all that says
        which order the next pass takes, as the global generator's state does for the rest."""
        return [g.get_state() for g in sampling.generators(self.loader)]

    def resume(
        self,
        epoch: int,
        position: int,
        rng: dict[str, Any] | None,
        generators: list[torch.Tensor] | None = None,
    ) -> None:
        """Continue from a checkpoint: the next pass skips ``position`` batches and starts
        from the random state ``rng`` (what :meth:`pass_rng` returned when it was saved);
        the private generators take the states ``generators`` (what
        :meth:`generator_states` returned then; None, or another count of them, leaves them
        as they are: a checkpoint written before they were saved)."""
        self.epoch, self._left = epoch, None
        self._resume = _Resume(position, rng) if position else None
        own = sampling.generators(self.loader)
        if generators is not None and len(generators) == len(own):
            for g, state in zip(own, generators, strict=True):
                g.set_state(state)

    # -- passes --------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        if self._on_pass_start is not None:
            self._on_pass_start()
        resume, self._resume = self._resume, None
        if self._left is not None:  # a new pass: the one left early is over
            self._left, self.epoch = None, self.epoch + 1
        self._set_epoch()
        if isinstance(self.sampler, Dealt):  # rank 0's sampler generator, as Accelerate's pass
            self.sampler.synchronize()
        if self._told_epoch is not None:  # Accelerate's loader tells the dataset every pass
            self._told_epoch.set_epoch(self.epoch)
        generators = sampling.generators(self.loader)
        started = _Pass(self._steps(), _capture(generators))
        if resume is not None and resume.rng is not None:
            # Redo the draws the interrupted pass made when it started (its order, its
            # workers' seeds) from the state it started with; then go on from the state the
            # checkpoint restored, as the interrupted run went on after them.
            started.rng = resume.rng
            now = torch.get_rng_state()
            _restore(resume.rng, generators)
            batches = self._start(resume.position)
            torch.set_rng_state(now)
        else:
            batches = self._start(resume.position if resume else 0)
        started.position = resume.position if resume else 0
        self._live.append(started)
        return _PassIterator(self, started, self._on_device(batches), resume)

    def _on_device(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The pass's batches on the device, each wait for one measured when a meter is
        given (``gpukit.runtime.data.wait``: the host's clock around ``next()``, and on CUDA
        events the device records on its own stream: nothing read back here)."""
        ahead = self._order.reads_ahead
        if self._wait is None:
            moved = on_device(batches, self.device, read_ahead=ahead)
        else:
            marks = functools.partial(self._wait.device_marks, self.device)
            moved = on_device(self._wait.timed(batches, self), self.device, marks, read_ahead=ahead)
        # Cut on the device, after the copy: the whole batch's copy stays one pinned transfer.
        return moved if self._local is None else map(self._local, moved)

    def _start(self, skip: int) -> Iterator[Any]:
        if self._sampler is None:  # an iterable dataset: skip a resumed pass's batches by reading
            return itertools.islice(iter(self.loader), skip, None)
        self._sampler.begin(skip * self._unit)
        batches = iter(self.loader)  # the DataLoader's own draw: its workers' base seed
        self._sampler.draw_now()  # then the sampler's, as the first batch would make it
        return batches

    def _set_epoch(self) -> None:
        """``set_epoch(epoch)`` before each pass, unless the program manages it itself."""
        sampler = self.sampler
        if not self._epoch_owned or not hasattr(sampler, "set_epoch"):
            return
        if getattr(sampler, "epoch", None) != self._epoch_set:
            self._epoch_owned = False  # the program called set_epoch: its numbering wins
            return
        sampler.set_epoch(self.epoch)
        self._epoch_set = self.epoch

    def _finished(self, done: _Pass, exhausted: bool, resume: _Resume | None) -> None:
        if done not in self._live:
            return
        self._live.remove(done)
        trained = self._steps() > done.steps_at_start
        if not trained and self._wait is not None:
            self._wait.forget(self)  # an evaluation's or a peek's waits are not the steps'
        if exhausted:
            self.epoch += 1
            # Every rank's pass ends at the same batch when the sampler shards evenly, which
            # makes this a point where all of them meet (an iterable dataset gives no such
            # promise).
            if self._on_pass_end is not None and self._sampler is not None:
                self._on_pass_end(trained)
        elif trained:
            self._left = done
        elif resume is not None and self._resume is None:
            self._resume = resume  # a peek at a resumed pass: the loop still starts there


class _PassIterator:
    """The iterator of one pass: counts the batches it hands out, and tells the loader when
    the pass ends, run to its end or dropped (a peek, a ``break``)."""

    def __init__(
        self, owner: DeviceLoader, state: _Pass, batches: Iterator[Any], resume: _Resume | None
    ) -> None:
        self._owner, self._state, self._batches, self._resume = owner, state, batches, resume
        self._open = True

    def __iter__(self) -> _PassIterator:
        return self

    def __next__(self) -> Any:
        if self._owner._on_batch is not None:
            self._owner._on_batch()  # a save the last step left pending is made first
        try:
            batch = next(self._batches)
        except StopIteration:
            self._end(exhausted=True)
            raise
        self._state.position += 1
        if self._owner._on_handed is not None:
            self._owner._on_handed(self._owner, self._state.position, batch)
        return batch

    def _end(self, exhausted: bool) -> None:
        if self._open:
            self._open = False
            self._owner._finished(self._state, exhausted, self._resume)

    def __del__(self) -> None:
        self._end(exhausted=False)


def _capture(generators: list[torch.Generator]) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "generators": [g.get_state() for g in generators]}


def _restore(rng: dict[str, Any], generators: list[torch.Generator]) -> None:
    torch.set_rng_state(rng["torch"])
    for g, state in zip(generators, rng.get("generators", []), strict=False):
        g.set_state(state)
