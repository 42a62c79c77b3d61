"""What a workload is, and loading one by name: a built-in or ``"package.module:function"``.

>>> w = load_workload("mlp", seed=1)
>>> x, y = w.dataset[0]
>>> w.loss(w.model(x[None]), y[None]).shape
torch.Size([])
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch import nn
from torch.utils.data import Dataset

from gpukit._util.text import described, safe_repr, type_name
from gpukit.errors import ConfigError, GpukitError
from gpukit.runtime.settings_checks import SEED_RANGE
from gpukit.workloads.checks import check_parts
from gpukit.workloads.user_functions import failed_at, first_line, takes_seed, user_function

WorkloadName = Literal["mlp", "cnn", "gpt", "gpt2"]
WORKLOADS: tuple[WorkloadName, ...] = ("mlp", "cnn", "gpt", "gpt2")

# What a ``module:function`` workload that returns a bare (model, dataset, loss) tuple gets.
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 1e-3
DEFAULT_EPOCHS = 1

SizesT = TypeVar("SizesT")

_ALLOWED = (
    f"use one of {', '.join(WORKLOADS)}, or 'package.module:function' for a function that "
    "returns a Workload or a (model, dataset, loss) tuple"
)


@dataclass(frozen=True)
class Workload:
    """A model with the data, loss and hyper-parameters to train it.

    ``dataset`` items are ``(input, target)`` tensor pairs; ``loss(model(input), target)`` is
    the mean over the batch. ``flops_per_sample`` is the forward+backward training cost of one
    item (about 3x its forward FLOPs), 0.0 when unknown. ``sample``, where set, writes text
    with the trained model on the given device. ``validation``, where set, holds held-out
    ``(input, target)`` items that ``gpukit train`` evaluates at the end of every epoch (its
    ``val_loss``); ``accuracy`` True adds ``val_accuracy``, the share of items whose output's
    argmax over the last dimension is the target (a classifier's). ``data``, where set, says
    what the dataset holds when that depends on the machine or the options (gpt2's tokens:
    GPT-2's BPE, or bytes where tiktoken is missing); ``gpukit train`` shows it.

    >>> import torch
    >>> from torch import nn
    >>> data = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))
    >>> w = Workload("line", nn.Linear(2, 1), data, nn.MSELoss(), 4, 0.1, 1, 12.0)
    >>> w.batch_size, w.sample is None
    (4, True)
    """

    name: str
    model: nn.Module
    dataset: Dataset[Any]  # items: (input, target) tensors
    loss: Callable[[Any, Any], torch.Tensor]
    batch_size: int
    lr: float
    epochs: int
    flops_per_sample: float
    sample: Callable[[nn.Module, torch.device], str] | None = None
    validation: Dataset[Any] | None = None  # held out: never in ``dataset``
    accuracy: bool = False  # val_accuracy too: argmax of the output against the target
    data: str = ""  # what the dataset holds, where it depends on the machine or the options

    def __post_init__(self) -> None:
        problems = [
            f"{field}={value!r} (must be {rule})"
            for field, value, ok, rule in (
                ("batch_size", self.batch_size, _is_int(self.batch_size, 1), "an int >= 1"),
                ("lr", self.lr, _is_number(self.lr) and self.lr > 0, "a number > 0"),
                ("epochs", self.epochs, _is_int(self.epochs, 0), "an int >= 0"),
                (
                    "flops_per_sample",
                    self.flops_per_sample,
                    _is_number(self.flops_per_sample) and self.flops_per_sample >= 0,
                    "a number >= 0, 0.0 when unknown",
                ),
            )
            if not ok
        ]
        if problems:
            raise ConfigError(f"workload {self.name!r}: " + "; ".join(problems))


def load_workload(spec: str, *, seed: int = 0, meta: bool = False) -> Workload:
    """The workload ``spec`` names, its model initialised from ``seed``.

    ``spec`` is a built-in name (see :data:`WORKLOADS`) or ``"module:function"``: the
    function is called with ``seed=seed`` if it takes a ``seed`` argument, else with none,
    and returns a :class:`Workload` or a ``(model, dataset, loss)`` tuple (then
    ``batch_size=32, lr=1e-3, epochs=1, flops_per_sample=0.0``). The module must be
    importable, i.e. on ``sys.path``. Either way the global RNG state is left as it was:
    the model is built under a forked RNG seeded with ``seed``. Bad specs raise
    :class:`~gpukit.errors.ConfigError`, and so does a workload that cannot train, before any
    process starts: a function that raises (naming its line) or returns something else, a
    module with a syntax error (its file, line and text), a model with nothing to train, an
    empty dataset, or items that are not (input, target) pairs the loader can stack.
    ``meta=True`` accepts a model on the meta device (shapes only), which the planner plans
    and training refuses.

    >>> a, b = load_workload("mlp", seed=3), load_workload("mlp", seed=3)
    >>> all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    True
    >>> load_workload("resnet50")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    gpukit.errors.ConfigError: unknown workload 'resnet50': ...
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"workload {described(spec)} is not a name: {_ALLOWED}")
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ConfigError(
            f"seed={described(seed)} must be an int from -2**63 to 2**63-1, e.g. seed=0"
        )
    spec = spec.strip()
    builder = _builtin(spec) if ":" not in spec else _user_function(spec)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched
        torch.manual_seed(seed)
        try:
            result = builder(seed=seed) if takes_seed(builder) else builder()
        except GpukitError:
            raise
        except Exception as err:
            if ":" not in spec:
                raise  # a built-in workload that fails is gpukit's bug: keep its traceback
            module_name, _, function_name = spec.partition(":")
            raise ConfigError(
                f"workload {spec!r}: {function_name}() failed{failed_at(err, module_name)} "
                f"with {type_name(err)}: {first_line(err)}: fix it (calling it in Python "
                "shows the whole traceback)"
            ) from err
    workload = _as_workload(spec, result)
    check_parts(
        name=workload.name,
        model=workload.model,
        dataset=workload.dataset,
        validation=workload.validation,
        loss=workload.loss,
        meta=meta,
    )
    return workload


def _builtin(name: str) -> Callable[..., Any]:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}: {_ALLOWED}")
    # Imported here: each module imports Workload from this one, and only the one asked for
    # needs loading (gpt reads its text, cnn builds images).
    module = importlib.import_module(f"gpukit.workloads.{name}")
    build: Callable[..., Any] = module.build
    return build


def _user_function(spec: str) -> Callable[..., Any]:
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name or ":" in function_name:
        raise ConfigError(
            f"workload {spec!r} is not 'module:function' (one colon, both parts given): {_ALLOWED}"
        )
    return user_function(spec, module_name, function_name)


def _as_workload(spec: str, result: object) -> Workload:
    if isinstance(result, Workload):
        return result
    if isinstance(result, tuple) and len(result) == 3:
        model, dataset, loss = result
        wrong = [
            f"{what} is {type(value).__name__}, expected {expected}"
            for what, value, ok, expected in (
                ("model", model, isinstance(model, nn.Module), "a torch.nn.Module"),
                (
                    "dataset",
                    dataset,
                    hasattr(dataset, "__getitem__"),
                    "a torch.utils.data.Dataset",
                ),
                ("loss", loss, callable(loss), "a callable loss(output, target)"),
            )
            if not ok
        ]
        if not wrong:
            return Workload(
                spec, model, dataset, loss, DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_EPOCHS, 0.0
            )
        detail = "; ".join(wrong)
    else:
        size = f" of {len(result)} items" if isinstance(result, tuple) else ""
        detail = f"it returned {safe_repr(result)} ({type_name(result)}{size})"
    raise ConfigError(
        f"workload {spec!r} must return a gpukit.workloads.Workload or a (model, dataset, loss) "
        f"tuple, but {detail}"
    )


def replaced(config: SizesT, changes: Mapping[str, object]) -> SizesT:
    """``config`` (a frozen dataclass of a model's sizes) with ``changes`` made, each checked
    against the field's kind: a whole number field takes an int >= 1, a flag a bool, a
    fraction a number >= 0. A name that is not a field, or a value of the wrong kind, is a
    :class:`~gpukit.errors.ConfigError` naming the fields.

    >>> from gpukit.workloads.gpt import GPTConfig
    >>> replaced(GPTConfig(vocab_size=65), {"n_layer": 1}).n_layer
    1
    >>> replaced(GPTConfig(vocab_size=65), {"layers": 1})  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    gpukit.errors.ConfigError: GPTConfig has no field layers: ...
    """
    names = [f.name for f in dataclasses.fields(config)]  # type: ignore[arg-type]
    kind = type(config).__name__
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise ConfigError(
            f"{kind} has no field {', '.join(unknown)}: its fields are {', '.join(names)}"
        )
    for name, value in changes.items():
        current = getattr(config, name)
        if isinstance(current, bool):
            ok, rule = isinstance(value, bool), "True or False"
        elif isinstance(current, int):
            ok, rule = _is_int(value, 1), "an int >= 1"
        else:
            ok, rule = _is_number(value) and float(value) >= 0, "a number >= 0"  # type: ignore[arg-type]
        if not ok:
            raise ConfigError(f"{kind}: {name}={described(value)} must be {rule}")
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]


def _is_int(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_EPOCHS",
    "DEFAULT_LR",
    "WORKLOADS",
    "Workload",
    "WorkloadName",
    "load_workload",
    "replaced",
]
