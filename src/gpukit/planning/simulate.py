"""The planner's simulation: gpukit's own training code over fake tensors, one rank standing
for N, in this CPU process.

Fake tensors have shapes, dtypes and devices but no values, so a forward of a model of any
size costs no memory and little time. A fake process group of N ranks (torch's, over a
store that answers every request) lets the real strategy code build what it builds for N
ranks: FSDP2 shards each parameter 1/N, DDP's buckets, the sampler's 1/N of each batch. The
simulation then runs the same sequence as ``gpukit train`` (the model, AdamW, the Runtime's
setup, batches from a DataLoader, ``rt.train_step`` and ``rt.log``) for two optimizer steps
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
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpukit import _env
from gpukit._util.fake import real_tensors
from gpukit.diagnostics.live_tensors import LiveTensors
from gpukit.diagnostics.trace import untraced
from gpukit.errors import GpukitError, SimulationUnsupported
from gpukit.planning import registered
from gpukit.planning.fake_world import fake_mode, fake_store, fake_world, preserved_random_state
from gpukit.planning.result import DevicePeak
from gpukit.planning.simulated_data import FakeCollate, Repeated, SameBatches, rank_batches
from gpukit.strategies.registry import STRATEGIES
from gpukit.workloads.base import Workload, load_workload

# Optimizer steps run: the first builds the optimizer's state, the second is a steady step and
# reaches the peak. gpukit train measures three (the third confirms it on real values); over
# fake tensors a third would replay the second op for op, on the same shapes, for a fifth of
# a simulation's time.
STEPS = 2
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
    # A fake process group only for a strategy with a process per device.
    ranks = devices if registered.traits(strategy).process_per_device else None
    with (
        quiet,
        _env.apart_from_this_run(),
        warnings.catch_warnings(),  # the simulated setup's warnings are not the user's
        preserved_random_state(),
        fake_world(ranks),
        untraced(),  # the simulation's reads are not the program's (under gk.trace)
        torch.inference_mode(False),
        torch.enable_grad(),  # a plan made under no_grad still trains
        fake_mode() as mode,
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
    if fake_store() is None:
        raise SimulationUnsupported(
            f"torch {torch.__version__} has no fake process group to simulate ranks with"
        )


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
    dataset = Repeated(workload.dataset, (STEPS + 1) * size * case.devices)
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
                batch_sampler=SameBatches(size, (STEPS + 1) * case.devices),
                collate_fn=FakeCollate(mode),
            )
            live.watch(model, [optimizer])
            wrapped, optimizer, loader = rt.setup(model, optimizer, loader)
            live.watch(rt.unwrap(wrapped), [optimizer])
            live.file_made("communication")
            criterion = rt.setup_criterion(workload.loss)

            def compute_loss(batch: Any) -> torch.Tensor:
                x, y = batch
                return criterion(wrapped(x), y)

            _train(rt, optimizer, rank_batches(loader, size), compute_loss, case.prefetch)
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
