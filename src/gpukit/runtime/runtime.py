"""Runtime: the one small object a training loop talks to.

It resolves the devices, picks the strategy and the precision, and then delegates: the same
loop runs on one CPU, one GPU, or one process per device under DDP.

>>> import torch, gpukit as gk
>>> from torch.utils.data import DataLoader, TensorDataset
>>> rt = gk.Runtime(devices="cpu", seed=0)
>>> model = torch.nn.Linear(4, 1)
>>> data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
>>> model, optimizer, loader = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
>>> for x, y in loader:
...     loss = torch.nn.functional.mse_loss(model(x), y)
...     rt.backward(loss)
...     _ = rt.step(optimizer)
...     rt.log(loss=loss)
>>> rt.global_step
2
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from gpukit import _env
from gpukit.devices.device import Device
from gpukit.devices.device import device as resolve_device
from gpukit.devices.device import devices as list_devices
from gpukit.diagnostics.oom import explain, is_oom
from gpukit.diagnostics.readable import reraise_readable
from gpukit.errors import ConfigError, OutOfMemory
from gpukit.runtime.data import DeviceLoader
from gpukit.runtime.precision import make_precision
from gpukit.strategies import ReduceOp, Strategy, make_strategy

DevicesSpec = Any  # "auto" | "all" | int | str | Sequence[str | int | Device]


class Runtime:
    """Strategy, precision, accumulation, clipping and logging behind one object.

    Args:
        strategy: "auto" (ddp under a launcher or with several devices, else single),
            "single", "dp", "dp-balanced", "ddp", or a strategy object such as
            ``gk.strategies.DDP(...)`` (see ``gpukit.strategies``).
        precision: "auto", "32", "bf16-mixed" or "16-mixed" (see ``gpukit.precision``).
        devices: "auto" (the best device), "all" (every GPU), N (N GPUs, or N CPU processes
            on a machine without GPUs), a spec such as "cuda:1", or a list of specs.
        accumulate: micro-batches per optimizer step; gradients are averaged over them and
            DDP synchronises only on the last one.
        clip: max gradient norm, or None.
        seed: seeds Python, NumPy and torch (the same on every rank, so replicas start equal);
            also seeds the data order. None: 0 for the data order, RNGs untouched.
        log_every: ``rt.log`` reads values back from the device only every this many calls.
        oom: what ``rt.train_step`` does when a device runs out of memory: "raise" (an
            ``OutOfMemory`` error that explains the numbers and what to try) or "recover"
            (cut the batch into more micro-batches and redo the step; see ``gpukit.recovery``).
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        precision: str = "auto",
        devices: DevicesSpec = "auto",
        accumulate: int = 1,
        clip: float | None = None,
        seed: int | None = None,
        log_every: int = 50,
        oom: Literal["raise", "recover"] = "raise",
    ) -> None:
        _check_positive_int("accumulate", accumulate)
        if oom not in ("raise", "recover"):
            raise ConfigError(f"oom={oom!r}: use 'raise' (explain and stop) or 'recover'")
        _check_positive_int("log_every", log_every)
        if clip is not None and not clip > 0:
            raise ConfigError(f"clip={clip!r}: give a positive max gradient norm, or None")
        self.config = {
            "strategy": strategy,
            "precision": precision,
            "devices": devices,
            "accumulate": accumulate,
            "clip": clip,
            "seed": seed,
            "log_every": log_every,
            "oom": oom,
        }
        launched = _env.launched()
        chosen = resolve_devices(devices, launched is not None)
        if strategy == "auto":
            strategy = "ddp" if launched is not None or len(chosen) > 1 else "single"
        self.strategy = make_strategy(strategy)
        self.strategy.configure(chosen)
        self.precision = make_precision(precision, self.strategy.device.torch)
        self.accumulate = accumulate
        self.clip = clip
        self.seed = seed
        self.log_every = log_every
        self.oom = oom
        self.oom_split = 1  # micro-batches per accumulation step, raised by OOM recovery
        self.oom_events: list[dict[str, Any]] = []  # every recovery: step, sizes before/after
        self.fault_oom_above = _env.fault_oom_above()
        self.global_step = 0  # optimizer steps taken
        self.micro_step = 0  # backward passes taken
        self._stepped_at = 0  # micro_step at the last rt.step call
        self.history: list[dict[str, float]] = []
        self.loaders: list[DeviceLoader] = []
        self._modules: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}
        self._log_calls = 0
        self._gradients_checked = False
        self._recovery_checked = False
        self._ready = False
        if seed is not None:
            seed_everything(seed)

    # -- where this process sits ------------------------------------------------------------
    @property
    def device(self) -> Device:
        """The device this process trains on."""
        return self.strategy.device

    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    # -- setup ----------------------------------------------------------------------------------
    def launch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(runtime, *args)`` on every rank and return rank 0's result.

        Starts one process per device when the strategy needs them and none are running yet
        (``fn`` must then be a module-level function); otherwise calls ``fn`` here.
        """
        if not self.strategy.needs_launch:
            return fn(self, *args)
        from gpukit.runtime.launch import spawn

        return spawn(self.config, self.world_size, fn, args)

    def setup(self, model: nn.Module, *objects: Any) -> Any:
        """Place the model for the strategy and precision, and wrap DataLoaders.

        Returns the model alone, or the model and every other argument in the same order
        (optimizers as given, DataLoaders as :class:`DeviceLoader`).
        """
        self._ensure_ready()
        module = self.strategy.setup_module(model)
        self.precision.wrap_forward(module)
        self._modules.append(module)
        self._optimizers += [o for o in objects if isinstance(o, torch.optim.Optimizer)]
        self._sync_next_backward()
        out = [module] + [self.setup_loader(o) if isinstance(o, DataLoader) else o for o in objects]
        return out[0] if len(out) == 1 else tuple(out)

    def setup_loader(self, loader: DataLoader[Any]) -> DeviceLoader:
        """Shard, re-seed every epoch, and move batches to the device (see ``gpukit.data``)."""
        self._ensure_ready()
        shards, shard = self.strategy.sampler_placement()
        wrapped = DeviceLoader(loader, self.device.torch, shards, shard, self.seed or 0)
        self.loaders.append(wrapped)
        return wrapped

    def setup_criterion(
        self, fn: Callable[..., torch.Tensor], reduction: Literal["mean", "sum"] | None = None
    ) -> Callable[..., torch.Tensor]:
        """The loss function as the strategy computes it: itself for single, ddp and dp; on
        every device for dp-balanced, where ``reduction`` (default: the loss module's own, else
        "mean") says how to combine the per-device losses. Called the same way everywhere:
        ``criterion(model(x), y)``. For cross-entropy and NLL losses, the first call checks
        that the class targets lie in ``[0, num_classes)`` (a readable error here, rather than
        a device-side assert on a GPU); the loss module itself is returned unchanged."""
        from gpukit.runtime.targets import with_target_check

        return with_target_check(fn, self.strategy.setup_criterion(fn, reduction))

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's model inside what ``setup`` returned."""
        return self.strategy.unwrap(module)

    # -- the step -----------------------------------------------------------------------------
    def train_step(
        self,
        optimizer: torch.optim.Optimizer,
        batch: Any,
        compute_loss: Callable[[Any], torch.Tensor],
    ) -> torch.Tensor:
        """One optimizer step over ``batch``: ``compute_loss(micro_batch)`` (the mean loss of
        the samples it is given) on each of ``accumulate`` micro-batches, backward, step.

        With ``oom="recover"`` an out-of-memory error re-cuts the batch into more micro-batches
        and redoes the step, with the same result. Returns the batch's mean loss, on the device
        (log it with ``rt.log``: reading it here would stall the GPU).

        >>> import torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu", accumulate=2)
        >>> model = torch.nn.Linear(2, 1)
        >>> model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> x, y = torch.ones(6, 2), torch.zeros(6, 1)
        >>> mse = torch.nn.functional.mse_loss
        >>> loss = rt.train_step(opt, (x, y), lambda b: mse(model(b[0]), b[1]))
        >>> rt.global_step
        1
        """
        from gpukit.runtime.step import run_step

        self._ensure_ready()
        return run_step(self, optimizer, batch, compute_loss)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass in the run's precision, averaged over accumulated micro-batches."""
        if self.accumulate > 1:
            loss = loss / self.accumulate
        try:
            self.precision.backward(loss)
        except Exception as err:
            if is_oom(err):
                raise self.out_of_memory(err) from err
            reraise_readable(err)
        self.micro_step += 1
        self._check_gradients_once()

    def _check_gradients_once(self) -> None:
        if not self._gradients_checked:
            self._gradients_checked = True
            for module in self._modules:
                self.strategy.check_gradients(module)

    def out_of_memory(
        self, err: BaseException | str, micro_batch: int | None = None
    ) -> OutOfMemory:
        """The error to raise for an out-of-memory ``err``: its numbers, explained with what
        this run knows (weights and optimizer state, strategy, imbalance between devices)."""
        from gpukit.diagnostics.memory import breakdown, report

        state_bytes = imbalance = None
        # The explanation must never hide the error it explains: what cannot be read stays None.
        with contextlib.suppress(Exception):
            total = 0
            for i, module in enumerate(self._modules):
                optimizer = self._optimizers[i] if i < len(self._optimizers) else None
                parts = breakdown(self.unwrap(module), optimizer)
                total += parts.parameters + parts.gradients + parts.optimizer_state
            state_bytes = total
        with contextlib.suppress(Exception):
            if len(self.strategy.devices) > 1 and self.world_size == 1:
                devices = [d.torch for d in self.strategy.devices]
                imbalance = report(devices, all_ranks=False).imbalance
        explanation = explain(
            err,
            state_bytes=state_bytes,
            strategy=self.strategy.name,
            imbalance=imbalance,
            micro_batch=micro_batch,
        )
        return OutOfMemory(str(explanation))

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, clip, step and zero the gradients once every ``accumulate`` calls.

        Returns True when the optimizer stepped (False while accumulating, or when 16-mixed
        skipped a step whose gradients overflowed).
        """
        if self.micro_step == self._stepped_at:
            raise ConfigError(
                "rt.step(optimizer) was called without rt.backward(loss) since the last step: "
                "call rt.backward(loss) once per micro-batch, then rt.step(optimizer)"
            )
        self._stepped_at = self.micro_step
        if self.micro_step % self.accumulate != 0:
            self._sync_next_backward()
            return False
        return self._optimizer_step(optimizer)

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        try:
            if self.clip is not None:
                self.precision.unscale(optimizer)
                params = [p for group in optimizer.param_groups for p in group["params"]]
                torch.nn.utils.clip_grad_norm_(params, self.clip)
            stepped = self.precision.step(optimizer)
        except Exception as err:
            # Not recoverable by smaller micro-batches: the optimizer state is what grew.
            if is_oom(err):
                raise self.out_of_memory(err) from err
            reraise_readable(err)
        optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self._sync_next_backward()
        return stepped

    def _sync_next_backward(self) -> None:
        # The next backward is the last of its accumulation window exactly when this holds;
        # the others skip DDP's all-reduce (its forward must already know).
        sync = (self.micro_step + 1) % self.accumulate == 0
        for module in self._modules:
            self.strategy.set_backward_sync(module, sync)

    # -- metrics --------------------------------------------------------------------------------
    def log(self, **metrics: torch.Tensor | float) -> None:
        """Accumulate metrics on the device; every ``log_every`` calls, average them over the
        calls and the ranks, read them back once, and append them to ``rt.history``."""
        for name, value in metrics.items():
            t = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            if name in self._sums:
                self._sums[name].add_(t.to(self._sums[name].device))
                self._counts[name] += 1
            else:
                self._sums[name] = t.to(self.device.torch, torch.float32, copy=True)
                self._counts[name] = 1
        self._log_calls += 1
        if self._log_calls % self.log_every == 0:
            self.flush_logs()

    def flush_logs(self) -> dict[str, float]:
        """Read back what ``log`` accumulated now (every rank must call it together)."""
        self._ensure_ready()
        names = sorted(self._sums)
        if self.world_size > 1 and len(set(map(tuple, self.strategy.all_gather_object(names)))) > 1:
            raise ConfigError(
                "rt.log got different metric names on different ranks: log the same names on "
                "every rank, the same number of times (values are averaged across ranks)"
            )
        if not names:
            return {}
        means = torch.stack([self._sums[n] / self._counts[n] for n in names])
        values = self.strategy.all_reduce(means, "mean").tolist()
        record = {"step": float(self.global_step), **dict(zip(names, values, strict=True))}
        self.history.append(record)
        self._sums.clear()
        self._counts.clear()
        return record

    # -- processes ------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Wait for every rank."""
        self._ensure_ready()
        self.strategy.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` combined over the ranks by "mean", "sum", "max" or "min"."""
        self._ensure_ready()
        return self.strategy.all_reduce(tensor, op)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if self.is_global_zero:
            builtins.print(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, directory: str | Path, keep: int = 3) -> Path:
        """Write a checkpoint of everything ``setup`` saw (see ``gpukit.checkpoint``)."""
        from gpukit.runtime.checkpoint import save

        self._ensure_ready()
        return save(self, Path(directory), keep=keep)

    def load(self, directory: str | Path) -> dict[str, int]:
        """Restore the newest checkpoint under ``directory``; returns its epoch and step."""
        from gpukit.runtime.checkpoint import load

        self._ensure_ready()
        progress = load(self, Path(directory))
        self._sync_next_backward()  # the DDP sync flag must follow the restored micro_step
        return progress

    def teardown(self) -> None:
        """Drop the wrapped models, then leave the process group this Runtime joined."""
        # DDP's reducer must go while its process group still exists: destroyed later, by the
        # garbage collector at interpreter exit, it can block the process forever.
        self._modules.clear()
        self._optimizers.clear()
        self.loaders.clear()
        gc.collect()
        self.strategy.teardown()

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        if self.strategy.needs_launch:
            raise ConfigError(
                f"strategy {self.strategy.name!r} needs {self.world_size} processes: put the "
                "training in a function and start it with rt.launch(fn), or run the script "
                f"with `gpukit launch --nproc {self.world_size}`"
            )
        self.strategy.setup_environment()
        self._ready = True


def resolve_devices(spec: DevicesSpec, launched: bool = False) -> list[Device]:
    """The devices a ``devices=`` argument asks for (duplicates allowed: CPU processes).

    Under a launcher "auto" means one device per local process: the GPU of the local rank
    when there are enough GPUs, else the CPU.
    """
    gpus = [d for d in list_devices() if d.type == "cuda"]
    if isinstance(spec, bool):
        raise ConfigError(f"devices={spec!r}: use 'auto', 'all', a count, or a list of devices")
    if isinstance(spec, int):
        if spec < 1:
            raise ConfigError(f"devices={spec}: give at least 1")
        if not gpus:
            return [resolve_device("cpu")] * spec
        if spec > len(gpus):
            raise ConfigError(
                f"devices={spec}, but this machine has {len(gpus)} GPU(s) "
                f"({', '.join(map(str, gpus))}): use devices={len(gpus)} or fewer"
            )
        return gpus[:spec]
    if spec == "auto":
        if launched:
            env = _env.launched()
            local = env.local_world_size if env else 1
            return gpus[:local] if len(gpus) >= local else [resolve_device("cpu")] * local
        return [resolve_device()]
    if spec == "all":
        return gpus or [resolve_device("cpu")]
    if isinstance(spec, str) and "," in spec:
        spec = [s.strip() for s in spec.split(",")]
    if isinstance(spec, str) or not isinstance(spec, Sequence):
        return [resolve_device(spec)]
    if not spec:
        raise ConfigError("devices=[]: give at least one device")
    return [resolve_device(s) for s in spec]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
