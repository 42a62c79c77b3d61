"""The planner's simulation: gpukit's own training code over fake tensors, one rank standing
for N, in this CPU process.

Fake tensors have shapes, dtypes and devices but no values, so a forward of a model of any
size costs no memory and little time. A fake process group of N ranks (torch's, over a
store that answers every request) lets the real strategy code build what it builds for N
ranks: FSDP2 shards each parameter 1/N, DDP's buckets, the sampler's 1/N of each batch. The
simulation then runs the same sequence as ``gpukit train`` (the model, AdamW, the Runtime's
setup, batches from a DataLoader, ``rt.train_step`` and ``rt.log``) for three optimizer steps
under :class:`~gpukit.diagnostics.live_tensors.LiveTensors`, the counter ``gpukit train``
measures with: what it predicts is the peak of the same quantity, counted the same way.

What it cannot run, it says (:class:`SimulationUnsupported`) and the planner falls back to the
closed form: a strategy whose traits say one process drives every device with threads (dp,
dp-balanced), a process that already joined a process group, a torch without a fake process
group, a model whose forward needs values (data-dependent Python), more ranks than a Runtime
may address here.

Fidelity: the simulation saves and restores the process's random state, and leaves no process
group, mode or patch behind, so a program that plans and then trains trains as it would have.

>>> peaks = simulate("mlp", strategy="fsdp", devices=2, micro_batch=8)
>>> len(peaks), peaks[0].peak_bytes > 0
(2, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import random
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gpukit import _env
from gpukit._util.fake import real_tensors
from gpukit._util.tree import map_tensors
from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.diagnostics.trace import untraced
from gpukit.errors import GpukitError, SimulationUnsupported
from gpukit.planning import registered
from gpukit.planning.result import DevicePeak
from gpukit.strategies.registry import STRATEGIES
from gpukit.workloads.base import Workload, load_workload

# Optimizer steps run: the peak of a steady step is reached by the second, once the
# optimizer's state exists (gpukit train measures the same window).
STEPS = 3
# Samples per step of one rank the simulation reads through the loader (one index and one
# item reference each); beyond, the closed form answers.
MAX_SAMPLES = 2**20


@dataclass(frozen=True)
class Case:
    """What to simulate: a strategy on ``devices`` ranks, ``micro_batch`` samples per rank per
    micro-step, ``accumulate`` micro-steps per optimizer step."""

    strategy: str
    devices: int
    micro_batch: int
    accumulate: int = 1
    precision: str = "32"
    activation_checkpointing: str = "off"
    granularity: int = 1
    prefetch: bool = False  # the next batch is on the device during a step (CUDA loaders)


def simulate(
    workload: str | Callable[[], Workload] | Workload,
    *,
    strategy: str,
    devices: int,
    micro_batch: int,
    accumulate: int = 1,
    precision: str = "32",
    activation_checkpointing: str = "off",
    granularity: int = 1,
    seed: int = 0,
) -> tuple[DevicePeak, ...]:
    """Each rank's peak tensor memory (with its breakdown) for ``workload`` trained as ``gpukit
    train`` trains it; see the module doc. ``workload``: a built-in's name, ``module:function``,
    a function returning a Workload, or a Workload (its model is copied as fake tensors)."""
    case = Case(
        strategy, devices, micro_batch, accumulate, precision, activation_checkpointing, granularity
    )
    _check_supported(case)
    # The strategies print what they set up (fsdp's plan): planning is not setting up.
    quiet = contextlib.redirect_stdout(io.StringIO())
    with (
        quiet,
        _env.apart_from_this_run(),
        warnings.catch_warnings(),  # the simulated setup's warnings are not the user's
        _preserved_random_state(),
        _fake_world(case),
        untraced(),  # the simulation's reads are not the program's (under gk.trace)
        torch.inference_mode(False),
        torch.enable_grad(),  # a plan made under no_grad still trains
        _fake_mode() as mode,
    ):
        warnings.simplefilter("ignore")
        built = _fake_workload(workload, mode, seed)
        breakdown = _run(built, case, mode)
    return tuple(DevicePeak(_name(case, rank), dict(breakdown)) for rank in range(devices))


def simulated() -> tuple[str, ...]:
    """The registered strategies the simulation can run."""
    return tuple(s for s in registered.names() if not registered.traits(s).drives_all_devices)


def _check_supported(case: Case) -> None:
    traits = registered.traits(case.strategy)
    if traits.drives_all_devices:
        raise SimulationUnsupported(
            f"the simulation runs {', '.join(simulated())}: {case.strategy} drives every GPU "
            "from one process with threads, which one fake rank cannot stand for"
        )
    if case.activation_checkpointing != "off" and not traits.activation_checkpointing:
        having = " and ".join(registered.with_checkpointing()) or "no strategy"
        raise SimulationUnsupported(
            f"activation checkpointing is an {having} setting in gpukit; {case.strategy} has none"
        )
    if not traits.process_per_device:
        return  # no process group of its own
    if dist.is_available() and dist.is_initialized():
        raise SimulationUnsupported(
            "this process already joined a process group; the simulation needs its own (fake) "
            "one: plan before init_process_group or rt.setup, or run `gpukit plan`"
        )
    if _fake_store() is None:
        raise SimulationUnsupported(
            f"torch {torch.__version__} has no fake process group to simulate ranks with"
        )


def _fake_store() -> Any:
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return FakeStore


@contextlib.contextmanager
def _fake_world(case: Case) -> Iterator[None]:
    """A fake process group of ``case.devices`` ranks, this process rank 0 (none for a
    strategy without a process per device)."""
    if not registered.traits(case.strategy).process_per_device:
        yield
        return
    dist.init_process_group("fake", store=_fake_store()(), rank=0, world_size=case.devices)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _fake_mode() -> Iterator[Any]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Real inputs (the dataset's items) turn into fake ones where they meet fake tensors.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def _preserved_random_state() -> Iterator[None]:
    """Building a workload seeds torch's generators and the loader draws from them; the
    program that planned must not notice: Python's, numpy's and torch's CPU state are
    restored, and so are the GPUs' where CUDA has started. Where it has not, seeding the GPUs
    is left out: torch would queue it for when CUDA starts, after the program's own seed."""
    py, np_state = random.getstate(), np.random.get_state()
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    gpus = list(range(torch.cuda.device_count())) if cuda_started else []
    seed_gpus = torch.cuda.manual_seed_all
    try:
        if not cuda_started:
            torch.cuda.manual_seed_all = _no_gpu_seed
        with torch.random.fork_rng(devices=gpus):
            yield
    finally:
        torch.cuda.manual_seed_all = seed_gpus
        random.setstate(py)
        np.random.set_state(np_state)


def _no_gpu_seed(seed: int) -> None:
    """Seeding GPUs that have not started, left out while simulating (see above)."""


def _fake_workload(workload: Any, mode: Any, seed: int) -> Workload:
    """The workload with fake parameters: built inside the fake mode, where its code allows
    (nothing real allocated); else built for real (fake tensors paused: a dataset made from
    values) and its model copied into fake tensors (the real one is dropped at once)."""
    if isinstance(workload, Workload):
        return dataclasses.replace(workload, model=_fake_copy(workload.model, mode))
    built = _built_with_fake_tensors(workload, seed)
    if built is not None:
        return built
    try:
        with real_tensors():
            real = _built(workload, seed)
        return dataclasses.replace(real, model=_fake_copy(real.model, mode))
    except GpukitError:
        raise
    except Exception as err:
        raise SimulationUnsupported(
            f"the model could not be copied into fake tensors ({_first_line(err)})"
        ) from err


def _fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors of the same shapes,
    dtypes and devices (a tied parameter stays one); the rest is copied as it is."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = mode.from_tensor(b)
    with real_tensors():
        return copy.deepcopy(model, memo)


def _built_with_fake_tensors(workload: Any, seed: int) -> Workload | None:
    """The workload built inside the fake mode; None when its code reads values somewhere
    (a dataset made from data), so that it must be built for real."""
    try:
        return _built(workload, seed)
    except GpukitError:
        raise
    except Exception:
        return None


def _built(workload: Any, seed: int) -> Workload:
    if callable(workload) and not isinstance(workload, str):
        built = workload()
        if not isinstance(built, Workload):
            raise SimulationUnsupported(
                f"the workload function returned {type(built).__name__}, not a Workload"
            )
        return built
    return load_workload(workload, seed=seed)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _runtime(case: Case) -> Any:
    from gpukit.runtime.runtime import Runtime

    # The strategy as it simulates itself (ddp: a stand-in for the reducer, which reads
    # values), with its own activation checkpointing where it has one.
    strategy = STRATEGIES[case.strategy].for_simulation(
        activation_checkpointing=case.activation_checkpointing
    )
    one = not registered.traits(case.strategy).process_per_device
    devices: Any = "cpu" if one else ["cpu"] * case.devices
    # log_every beyond the steps run: a flush reads values, which fake tensors do not have.
    # No seed: seeding would reset every generator of the program that plans (CUDA's too),
    # and values do not matter to memory.
    return Runtime(
        strategy=strategy,
        devices=devices,
        precision=case.precision,
        accumulate=case.accumulate,
        log_every=STEPS + 1,
    )


def _run(workload: Workload, case: Case, mode: Any) -> dict[str, int]:
    size = case.micro_batch * case.accumulate
    if size > MAX_SAMPLES:
        raise SimulationUnsupported(
            f"{size:,} samples per step of one rank: the loader would list every one of them; "
            f"the simulation reads at most {MAX_SAMPLES:,}"
        )
    dataset = _Repeated(workload.dataset, (STEPS + 1) * size * case.devices)
    rt = _runtime(case)
    model = workload.model
    live = LiveTensors(case.granularity)
    try:
        with live:
            optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
            # Batches of the repeated first item, listed at once: a shuffle's permutation is a
            # transient at the start of a pass, far below any step's peak, and listing index by
            # index would cost seconds for a batch of a million samples over 64 ranks.
            loader = torch.utils.data.DataLoader(
                dataset,
                batch_sampler=_SameBatches(size, (STEPS + 1) * case.devices),
                collate_fn=_FakeCollate(mode),
            )
            live.watch(model, [optimizer])
            wrapped, optimizer, loader = rt.setup(model, optimizer, loader)
            live.watch(rt.unwrap(wrapped), [optimizer])
            live.file_made("communication")
            criterion = rt.setup_criterion(workload.loss)

            def compute_loss(batch: Any) -> torch.Tensor:
                x, y = batch
                return criterion(wrapped(x), y)

            _train(rt, optimizer, _batches(loader, case), compute_loss, case.prefetch)
    except SimulationUnsupported:
        raise
    except GpukitError:
        raise
    except Exception as err:
        raise SimulationUnsupported(
            f"the training step could not run on fake tensors ({_first_line(err)})"
        ) from err
    finally:
        rt.teardown()
    return live.peak_breakdown.get("cpu", {})


class _Repeated(torch.utils.data.Dataset):
    """``length`` items, each the dataset's first: batches are stacked from items of one
    shape (gpukit train's default collation needs that too), and only shapes matter to
    memory. Long enough that every simulated step reads a full batch within one pass (a
    pass's end reads the logged values), and one item read however large the batch."""

    def __init__(self, dataset: Any, length: int) -> None:
        try:
            size = len(dataset)
        except TypeError:
            raise SimulationUnsupported(
                "the dataset has no length (an iterable dataset): the simulation reads its "
                "items by index"
            ) from None
        if size == 0:
            raise SimulationUnsupported("the dataset is empty: there is no batch to simulate")
        self.item, self.length = dataset[0], max(size, length)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return self.item

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [self.item] * len(indices)


class _SameBatches:
    """A batch sampler: ``count`` batches of ``size`` indices (all the repeated item's)."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.count = size, count

    def __iter__(self) -> Iterator[list[int]]:
        return ([0] * self.size for _ in range(self.count))

    def __len__(self) -> int:
        return self.count


class _FakeCollate:
    """The default collation's result as fake tensors: for each tensor of an item, one new
    tensor of the items stacked, as ``torch.stack`` makes, without reading the items (a batch
    of any size costs no memory or time here; the loader itself runs with real tensors, see
    :func:`_batches`)."""

    def __init__(self, mode: Any) -> None:
        self.mode = mode

    def __call__(self, items: list[Any]) -> Any:
        # Every item is the repeated first one: its tensors, each stacked len(items) times.
        with self.mode:
            return map_tensors(
                items[0],
                lambda t: torch.empty((len(items), *t.shape), dtype=t.dtype, device=t.device),
            )


def _batches(loader: Any, case: Case) -> Iterator[Any]:
    """One rank's batches from gpukit's own loader, as ``gpukit train`` reads them: the
    shuffle, the sampler's shard and the loader's seed are values, drawn with real tensors;
    the batches themselves are collated into fake ones."""
    with real_tensors():
        batches = iter(loader)
    while True:
        with real_tensors():
            batch = next(batches, None)
        if batch is None:
            raise SimulationUnsupported(
                f"one optimizer step of one rank needs {case.micro_batch * case.accumulate} "
                "samples, more than one pass over the dataset holds: give a smaller "
                "micro-batch or accumulation"
            )
        yield batch


def _train(
    rt: Any,
    optimizer: Any,
    batches: Iterator[Any],
    compute_loss: Callable[[Any], Any],
    prefetch: bool,
) -> None:
    # On a GPU gpukit's loader copies the next batch while this one trains: two are live.
    following = next(batches) if prefetch else None
    for _ in range(STEPS):
        batch = following if prefetch else next(batches)
        following = next(batches) if prefetch else None
        loss = rt.train_step(optimizer, batch, compute_loss)
        rt.log(loss=loss)
        del batch, loss


def _name(case: Case, rank: int) -> str:
    return f"rank {rank}" if registered.traits(case.strategy).process_per_device else "device 0"
