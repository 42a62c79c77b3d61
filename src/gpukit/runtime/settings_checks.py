"""The checks behind the Runtime's settings (declared in :mod:`gpukit.runtime.settings`), and
the devices a ``devices=`` setting names.

>>> check_oom("sometimes")
Traceback (most recent call last):
...
gpukit.errors.ConfigError: oom='sometimes': use 'raise' (explain and stop), 'recover' ...
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from torch import nn

from gpukit._util import placement
from gpukit._util.text import described
from gpukit.devices import Device
from gpukit.devices import device as resolve_device
from gpukit.devices import devices as list_devices
from gpukit.devices import hw as _hw
from gpukit.errors import ConfigError
from gpukit.lifecycle.checks import parse_save_every
from gpukit.runtime.step.nonfinite import check_policy
from gpukit.strategies import Strategy

DevicesSpec = Any  # "auto" | "all" | int | str | Sequence[str | int | Device]
OomPolicy = Literal["raise", "recover", "auto"]

# Seeds torch takes run from -2**63 to 2**64 - 1, but the data order seeds a generator with
# seed + epoch: a signed 64-bit seed leaves room for every epoch.
SEED_RANGE = (-(2**63), 2**63 - 1)
# Counts (accumulate, log_every) above this are never reached by a run: the optimizer would
# never step, the metrics never be read.
MAX_COUNT = 2**31 - 1
# CPU processes beyond this many per core only contend for the cores (each holds a whole
# replica of the model); a floor of 64 still lets a small machine rehearse a large job.
CPU_PROCESSES_PER_CORE = 4
MIN_CPU_PROCESS_LIMIT = 64


def resolve_devices(spec: DevicesSpec, launched: bool = False) -> list[Device]:
    """The devices a ``devices=`` argument asks for (duplicates allowed: CPU processes).

    Under a launcher "auto" means one device per local process: the GPU of the local rank
    when there are enough GPUs, else the CPU; and "cpu" means the CPU for every local process
    (Accelerate's ``cpu=True``, Fabric's ``accelerator="cpu"``: as many gloo ranks as the
    launcher started, GPUs or not).
    """
    gpus = [d for d in list_devices() if d.type == "cuda"]
    if isinstance(spec, (bool, bytes, bytearray)):
        raise ConfigError(
            f"devices={described(spec)}: use 'auto', 'all', a count, or a list of devices"
        )
    if isinstance(spec, int):
        if spec < 1:
            raise ConfigError(f"devices={spec}: give at least 1")
        if not gpus:
            _check_cpu_processes(spec, f"devices={spec}")
            return [resolve_device("cpu")] * spec
        if spec > len(gpus):
            raise ConfigError(
                f"devices={spec}, but this machine has {len(gpus)} GPU(s) "
                f"({', '.join(map(str, gpus))}): use devices={len(gpus)} or fewer"
            )
        return gpus[:spec]
    if isinstance(spec, str) and spec == "auto":
        if launched:
            local = _local_processes()
            if len(gpus) >= local:
                return gpus[:local]
            _check_cpu_processes(local, f"LOCAL_WORLD_SIZE={local}")
            return [resolve_device("cpu")] * local
        return [resolve_device()]
    if isinstance(spec, str) and spec == "all":
        return gpus or [resolve_device("cpu")]
    if isinstance(spec, str) and "," in spec:
        spec = [s.strip() for s in spec.split(",")]
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        one = resolve_device(spec)
        if launched and one.type == "cpu":
            local = _local_processes()
            _check_cpu_processes(local, f"devices={described(spec)} with LOCAL_WORLD_SIZE={local}")
            return [one] * local
        return [one]
    try:
        items = list(spec)
    except Exception as err:  # a sequence whose own methods fail
        raise ConfigError(
            f"devices={described(spec)}: reading the list failed with {type(err).__name__}: "
            "give a plain list of devices, e.g. devices=['cuda:0', 'cuda:1']"
        ) from err
    if not items:
        raise ConfigError("devices=[]: give at least one device")
    _check_cpu_processes(len(items), f"devices=[...] of {len(items)} entries")
    for i, item in enumerate(items):
        if item is None:
            raise ConfigError(
                f"devices[{i}] is None: name each device, e.g. devices=['cuda:0', 'cuda:1'] or "
                "['cpu', 'cpu'] (or devices='auto' for the best one)"
            )
    return [resolve_device(s) for s in items]


def check_device_count(spec: DevicesSpec, devices: list[Device], strategy: Strategy) -> None:
    """Refuse a strategy that needs more devices than ``devices="auto"``/``"all"`` found here
    (dp and dp-balanced drive several GPUs from one process; over the one CPU of a machine
    without GPUs they would train as ``single`` does, without a word). A list or a count
    given explicitly is the user's choice, and stays allowed."""
    least = strategy.traits.min_devices
    if not (isinstance(spec, str) and spec in ("auto", "all")) or len(devices) >= least:
        return
    gpus = [d for d in list_devices() if d.type == "cuda"]
    name = strategy.name
    found = (
        "this machine has no GPU, so it names the CPU alone"
        if not gpus
        else f"it names {len(devices)} of this machine's {len(gpus)} GPU(s)"
    )
    fixes = (
        "on a machine without GPUs use strategy='ddp' with devices=N for N CPU processes "
        "(gpukit train --strategy ddp --devices N), or strategy='single'"
        if not gpus
        else "use devices='all' on a machine with several GPUs, or strategy='single'"
    )
    raise ConfigError(
        f"strategy={name!r} drives {least} or more GPUs from one process, but "
        f"devices={spec!r} gives {len(devices)} device(s) ({found}): it would train on "
        f"{devices[0]} alone, as strategy='single' does. Instead, {fixes}; to rehearse {name} "
        "on the CPU, give the devices, e.g. devices=['cpu', 'cpu']"
    )


def cpu_process_limit() -> int:
    """The most processes ``devices=`` may ask for on this machine (see
    ``CPU_PROCESSES_PER_CORE``).

    >>> cpu_process_limit() >= MIN_CPU_PROCESS_LIMIT
    True
    """
    return max(MIN_CPU_PROCESS_LIMIT, CPU_PROCESSES_PER_CORE * _hw.cpu_cores()[0])


def _local_processes() -> int:
    """How many processes the launcher started on this machine (1 when none did)."""
    env = placement.launched()
    return env.local_world_size if env else 1


def _check_cpu_processes(count: int, given: str) -> None:
    """Refuse, before anything is allocated for them, more processes than the machine could
    run usefully."""
    limit = cpu_process_limit()
    if count > limit:
        cores = _hw.cpu_cores()[0]
        raise ConfigError(
            f"{given} asks for {count} processes, but this machine has {cores} CPU core(s) and "
            f"{len([d for d in list_devices() if d.type == 'cuda'])} GPU(s): give at most "
            f"{limit} (each process holds a whole model; more than {CPU_PROCESSES_PER_CORE} "
            "per core only contend for the cores)"
        )


def check_oom(oom: object) -> None:
    """ConfigError unless ``oom`` names an out-of-memory policy."""
    if not (isinstance(oom, str) and oom in get_args(OomPolicy)):
        raise ConfigError(
            f"oom={described(oom)}: use 'raise' (explain and stop), 'recover' (re-split "
            "the batch and redo the step) or 'auto' (recover where it costs nothing per "
            "step: one process; raise under several)"
        )


def check_count(name: str, value: object, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ConfigError(
            f"{name}={described(value)}: give a whole number of at least 1 and at most "
            f"{MAX_COUNT} ({meaning})"
        )


def check_clip(clip: object) -> None:
    if clip is None:
        return
    value = math.nan
    if isinstance(clip, numbers.Real) and not isinstance(clip, bool):
        try:
            value = float(clip)
        except OverflowError:  # an int beyond float's range
            value = math.inf
    if not 0 < value < math.inf:
        raise ConfigError(
            f"clip={described(clip)}: give a positive max gradient norm, a finite number such "
            "as clip=1.0, or None for no clipping"
        )


def check_seed(seed: object) -> None:
    if seed is None:
        return
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ConfigError(
            f"seed={described(seed)}: give a whole number from -2**63 to 2**63-1 "
            "(a signed 64-bit integer, e.g. seed=0), or None to leave the generators as they are"
        )


def parse_count_or_text(text: str) -> int | str:
    """A flag's text as a count when it is one (ASCII digits only: int() would read other
    scripts' digits too), else as given."""
    return int(text) if text.isascii() and text.isdigit() else text


def check_save_every(value: object) -> None:
    parse_save_every(value)  # type: ignore[arg-type]  # checks whatever it is given


def check_init(value: object) -> None:
    if value is not None and not callable(value):
        raise ConfigError(
            f"init={described(value)}: give a function taking a module (it initialises that "
            "module's own parameters and buffers), or None"
        )
    if value is None:
        return
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without one: its call will tell
        return
    try:
        signature.bind(nn.Module())
    except TypeError as err:
        # Refused here, not at rt.setup halfway through initialising a meta model.
        raise ConfigError(
            f"init={described(value)}: it cannot be called as init(module) ({err}): give a "
            "function of one argument, the module, e.g. def init(module): ..."
        ) from None


ExportPolicy = Literal["every", "never"]  # which fsdp checkpoints hold the full weights


def check_export(value: object) -> None:
    if not (isinstance(value, str) and value in get_args(ExportPolicy)):
        raise ConfigError(
            f"export={value!r}: use 'every' (every fsdp checkpoint also holds the full "
            "weights, model.safetensors) or 'never' (the shards alone, which resume the run; "
            "rt.save(export=True) exports one anyway)"
        )


def parse_on_off(text: str) -> bool:
    """A flag's on/off (also true/false, yes/no, 1/0) as a bool."""
    words = {"on": True, "true": True, "yes": True, "1": True}
    words |= {"off": False, "false": False, "no": False, "0": False}
    if text.lower() not in words:
        raise ConfigError(f"{text!r}: use on or off")
    return words[text.lower()]


def check_async_save(value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"async_save={value!r}: use True (checkpoints written by a thread while training "
            "goes on) or False (each save waits for its files)"
        )


def check_data_wait(value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"data_wait={value!r}: use True (rt.history records how long each window's steps "
            "waited for their batches) or False"
        )


DATA_ORDERS = ("torch", "accelerate")


def check_data_order(value: object) -> None:
    if value not in DATA_ORDERS:
        raise ConfigError(
            f"data_order={value!r}: use 'torch' (a shuffled loader gets a DistributedSampler "
            "seeded with the run's seed: PyTorch's DDP recipe, Lightning's order) or "
            "'accelerate' (whole batches dealt to the ranks in turn, the sampler seeded from "
            "the global generator: Accelerate's order)"
        )


def check_batch_dealing(name: str) -> Callable[[object], None]:
    """The check of ``even_batches`` or ``split_batches``: True, False, or None (Accelerate's
    default)."""

    def check(value: object) -> None:
        if value is not None and not isinstance(value, bool):
            raise ConfigError(
                f"{name}={value!r}: use True or False (or None: Accelerate's default), "
                "with data_order='accelerate'"
            )

    return check


def check_dealing_options(order: object, even_batches: object, split_batches: object) -> None:
    """Refuse Accelerate's batch options without its data order: they would change nothing."""
    given = [
        f"{name}={value!r}"
        for name, value in (("even_batches", even_batches), ("split_batches", split_batches))
        if value is not None
    ]
    if order != "accelerate" and given:
        raise ConfigError(
            f"{' and '.join(given)} with data_order={order!r}: these are options of "
            "Accelerate's data order, which deals whole batches to the ranks; use "
            "data_order='accelerate' with them, or leave them out (the 'torch' order pads "
            "every rank's share as a DistributedSampler does)"
        )


def check_nonfinite(value: object) -> None:
    if value is not None:
        check_policy(value)
