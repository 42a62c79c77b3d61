"""The training loops :mod:`gpukit.bench.overhead` times: one tiny training loop, run as plain
PyTorch and through each wrapper.

Every builder takes a model and its optimizer (from :func:`make_model_and_optimizer`, so every
variant starts from the same weights) and returns a function that runs one optimizer step per
batch of a list (from :func:`make_batches`, so every variant sees the same batches). The loss is
``F.cross_entropy`` in every variant, so the wrapper is all that differs; with precision "32" on
the CPU and one micro-batch per step, the gpukit variants compute exactly what plain computes.

>>> model, optimizer = make_model_and_optimizer()
>>> train_step_loop(model, optimizer)(make_batches(2))
"""

from __future__ import annotations

import importlib
import tempfile
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer

from gpukit.bench.train_defaults import runtime_settings
from gpukit.launch.heartbeat import Heartbeat
from gpukit.loggers.registry import make_loggers
from gpukit.runtime.runtime import Runtime
from gpukit.workloads import mlp

Batch = tuple[torch.Tensor, torch.Tensor]
Loop = Callable[[Sequence[Batch]], None]  # runs one training step per batch

BATCH_SIZE = 64
LR = 1e-3
SEED = 0
FABRIC_MODULES = ("lightning.fabric", "lightning_fabric")  # `lightning`, or Fabric alone

# What each wrapper is built with, as its constructor's keyword arguments (recorded in the
# results).
GPUKIT: dict[str, Any] = {"devices": "cpu", "precision": "32"}
TRAIN_STEP: dict[str, Any] = {"devices": "cpu"}  # the rest Runtime's defaults (precision 32)
ACCELERATE: dict[str, Any] = {"cpu": True}
FABRIC: dict[str, Any] = {"accelerator": "cpu", "devices": 1}


def train_default() -> dict[str, Any]:
    """``gpukit train``'s default Runtime settings, read from its parser, on the CPU.

    >>> train_default()["devices"], train_default()["log_every"]
    ('cpu', 10)
    """
    return runtime_settings(devices="cpu")


def make_model_and_optimizer(seed: int = SEED) -> tuple[nn.Module, Optimizer]:
    """A fresh MLP with the weights ``seed`` gives, and its AdamW (global RNG untouched).

    >>> a, _ = make_model_and_optimizer()
    >>> b, _ = make_model_and_optimizer()
    >>> torch.equal(a[0].weight, b[0].weight)
    True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = mlp.make_model()
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def make_batches(steps: int) -> list[Batch]:
    """``steps`` batches of 64 samples of the ``mlp`` data, the same on every call.

    >>> [tuple(t.shape) for t in make_batches(3)[0]]
    [(64, 32), (64,)]
    """
    x, y = mlp.make_dataset(steps * BATCH_SIZE).tensors
    return list(zip(x.split(BATCH_SIZE), y.split(BATCH_SIZE), strict=True))


def plain_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The reference loop: PyTorch alone.

    >>> model, optimizer = make_model_and_optimizer()
    >>> plain_loop(model, optimizer)(make_batches(2))
    """

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def plain_logged_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The reference for a loop that logs: PyTorch alone, keeping the loss on the device and
    reading its mean back every ``--log-every`` steps of ``gpukit train`` (nanoGPT's habit of
    logging at an interval, without a read every step).

    >>> model, optimizer = make_model_and_optimizer()
    >>> plain_logged_loop(model, optimizer)(make_batches(2))
    """
    history: list[float] = []
    every = int(train_default()["log_every"])

    def train(batches: Sequence[Batch]) -> None:
        total: torch.Tensor | None = None
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach() if total is None else total + loss.detach()
            if (i + 1) % every == 0:
                history.append(total.item() / every)
                total = None

    return train


def gpukit_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through gpukit's ``Runtime`` on the CPU in float32.

    >>> model, optimizer = make_model_and_optimizer()
    >>> gpukit_loop(model, optimizer)(make_batches(2))
    """
    rt = Runtime(**GPUKIT)
    model, optimizer = rt.setup(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            rt.step(optimizer)  # steps, then zero_grad(set_to_none=True)

    return train


def train_step_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop as one ``rt.train_step`` per batch, Runtime's default settings."""
    return _train_step(Runtime(**TRAIN_STEP), model, optimizer, log=False)


def train_default_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """``gpukit train``'s loop with its default settings: ``rt.train_step``, then
    ``rt.log(loss=loss)`` (read back every ``--log-every`` steps)."""
    return _train_step(Runtime(**train_default()), model, optimizer, log=True)


def logger_loop(name: str) -> Callable[[nn.Module, Optimizer], Loop]:
    """``gpukit train``'s default loop with the logger ``name`` ("csv", "tensorboard"), which
    writes into a temporary folder (removed with the loop): what a logger adds per step.

    >>> model, optimizer = make_model_and_optimizer()
    >>> logger_loop("csv")(model, optimizer)(make_batches(2))
    """

    def build(model: nn.Module, optimizer: Optimizer) -> Loop:
        folder = tempfile.TemporaryDirectory(prefix="gpukit-bench-")
        rt = Runtime(**train_default(), loggers=make_loggers([name], folder.name))
        inner = _train_step(rt, model, optimizer, log=True)

        def train(batches: Sequence[Batch], _folder: Any = folder) -> None:
            inner(batches)  # _folder: the folder lives as long as the loop

        return train

    return build


def heartbeat_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """``gpukit train``'s default loop on a rank gpukit's launcher watches: its heartbeat
    written, at every boundary the Runtime beats, into a file in a temporary folder (removed
    with the loop), as into the job's folder under the launcher. Nothing reads it: the cost is
    the rank's alone.

    >>> model, optimizer = make_model_and_optimizer()
    >>> heartbeat_loop(model, optimizer)(make_batches(2))
    """
    folder = tempfile.TemporaryDirectory(prefix="gpukit-bench-")
    rt = Runtime(**train_default())
    rt.lifecycle.watch(rt.device, rt.accumulate, Heartbeat(folder.name, rank=0))
    inner = _train_step(rt, model, optimizer, log=True)

    def train(batches: Sequence[Batch], _folder: Any = folder) -> None:
        inner(batches)  # _folder: the folder lives as long as the loop

    return train


def _train_step(rt: Runtime, model: nn.Module, optimizer: Optimizer, log: bool) -> Loop:
    model, optimizer = rt.setup(model, optimizer)

    def compute_loss(batch: Batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def train(batches: Sequence[Batch]) -> None:
        for batch in batches:
            loss = rt.train_step(optimizer, batch, compute_loss)
            if log:
                rt.log(loss=loss)

    return train


def accelerate_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through Hugging Face Accelerate on the CPU (raises ImportError without it)."""
    accelerator = import_first(("accelerate",)).Accelerator(**ACCELERATE)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def fabric_loop(model: nn.Module, optimizer: Optimizer) -> Loop:
    """The same loop through Lightning Fabric on the CPU (raises ImportError without it)."""
    fabric = import_first(FABRIC_MODULES).Fabric(**FABRIC)
    model, optimizer = fabric.setup(model, optimizer)

    def train(batches: Sequence[Batch]) -> None:
        for x, y in batches:
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train


def import_first(names: Sequence[str]) -> ModuleType:
    """The first of ``names`` that imports. When none does, the ImportError of an installed
    one that lacks a dependency if there is one (more useful than "not installed"), else the
    first.

    >>> import_first(("no_such_module_x", "math")).__name__
    'math'
    """
    errors: list[ImportError] = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as err:
            errors.append(err)
    raise next((e for e in errors if not is_missing(e, names)), errors[0])


def is_missing(err: ImportError, names: Sequence[str]) -> bool:
    """Whether ``err`` says that one of ``names`` itself (or its package) is not installed."""
    missing = err.name
    return bool(missing) and any(n == missing or n.startswith(f"{missing}.") for n in names)
