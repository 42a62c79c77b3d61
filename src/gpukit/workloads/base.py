"""What a workload is, and loading one by name: a built-in or ``"package.module:function"``.

>>> w = load_workload("mlp", seed=1)
>>> x, y = w.dataset[0]
>>> w.loss(w.model(x[None]), y[None]).shape
torch.Size([])
"""

from __future__ import annotations

import importlib
import inspect
import os
import reprlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from gpukit.errors import ConfigError

WorkloadName = Literal["mlp", "cnn", "gpt"]
WORKLOADS: tuple[WorkloadName, ...] = ("mlp", "cnn", "gpt")

# What a ``module:function`` workload that returns a bare (model, dataset, loss) tuple gets.
DEFAULT_BATCH_SIZE = 32
DEFAULT_LR = 1e-3
DEFAULT_EPOCHS = 1

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
    with the trained model on the given device.

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


def load_workload(spec: str, *, seed: int = 0) -> Workload:
    """The workload ``spec`` names, its model initialised from ``seed``.

    ``spec`` is a built-in name (see :data:`WORKLOADS`) or ``"module:function"``: the
    function is called with ``seed=seed`` if it takes a ``seed`` argument, else with none,
    and returns a :class:`Workload` or a ``(model, dataset, loss)`` tuple (then
    ``batch_size=32, lr=1e-3, epochs=1, flops_per_sample=0.0``). The module must be
    importable, i.e. on ``sys.path``. Either way the global RNG state is left as it was:
    the model is built under a forked RNG seeded with ``seed``. Bad specs raise
    :class:`~gpukit.errors.ConfigError`.

    >>> a, b = load_workload("mlp", seed=3), load_workload("mlp", seed=3)
    >>> all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    True
    >>> load_workload("resnet50")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    gpukit.errors.ConfigError: unknown workload 'resnet50': ...
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"workload {spec!r} is not a name: {_ALLOWED}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} must be an int, e.g. seed=0")
    spec = spec.strip()
    builder = _builtin(spec) if ":" not in spec else _user_function(spec)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched
        torch.manual_seed(seed)
        result = builder(seed=seed) if _takes_seed(builder) else builder()
    return _as_workload(spec, result)


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
    module = _import_user_module(spec, module_name)
    function = getattr(module, function_name, None)
    if function is None:
        found = sorted(
            name
            for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and not inspect.isclass(value)
        )
        raise ConfigError(
            f"workload {spec!r}: module {module_name!r} ({_where(module)}) has no "
            f"{function_name!r}; its public functions are {', '.join(found) or 'none'}: name "
            f"one of them, or define {function_name}() there"
        )
    if not callable(function):
        raise ConfigError(
            f"workload {spec!r}: {function_name!r} is of type {type(function).__name__}, not "
            "a function; name a function that returns a Workload or (model, dataset, loss)"
        )
    required = [
        p.name
        for p in _parameters(function)
        if p.default is p.empty
        and p.name != "seed"
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise ConfigError(
            f"workload {spec!r}: {function_name}() requires {', '.join(required)}, but it is "
            "called with no arguments (or seed= only); give them defaults or wrap it"
        )
    return function


def _import_user_module(spec: str, module_name: str) -> Any:
    """Import the user's module; anything that goes wrong is a one-line ConfigError naming the
    file and line, since a traceback through importlib says less than that."""
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        missing = err.name or ""
        if isinstance(err, ModuleNotFoundError) and (
            missing == module_name or module_name.startswith(missing + ".")
        ):
            raise ConfigError(
                f"workload {spec!r}: cannot import module {module_name!r} ({err}): there is no "
                f"{module_name.replace('.', '/')}.py in the current folder ({os.getcwd()}) nor "
                "elsewhere on sys.path; check the spelling, run from the folder that contains "
                "it, or add that folder to PYTHONPATH"
            ) from None
        raise ConfigError(
            f"workload {spec!r}: importing module {module_name!r} failed"
            f"{_failed_at(err, module_name)} with {type(err).__name__}: {_first_line(err)}: "
            "install the package it imports, or fix the import"
        ) from None
    except SyntaxError as err:
        where = f"{err.filename}, line {err.lineno}" if err.filename else module_name
        raise ConfigError(
            f"workload {spec!r}: a syntax error in {where}: {err.msg}: fix it and run again"
        ) from None
    except Exception as err:  # the module's own code failed while it was being imported
        raise ConfigError(
            f"workload {spec!r}: importing module {module_name!r} failed"
            f"{_failed_at(err, module_name)} with {type(err).__name__}: {_first_line(err)}: "
            "fix the module (or move that code into the function)"
        ) from None


def _failed_at(err: BaseException, module_name: str) -> str:
    """' (at FILE, line N)': the last line of the user's module the error went through, else
    the line that raised it."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename[:1] != "<"]
    tail = module_name.replace(".", os.sep)
    ends = (tail + ".py", os.path.join(tail, "__init__.py"))
    mine = [f for f in frames if f.filename.endswith(ends)] or frames[-1:]
    return f" (at {mine[-1].filename}, line {mine[-1].lineno})" if mine else ""


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _where(module: Any) -> str:
    return str(getattr(module, "__file__", None) or "built in")


def _parameters(function: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # some builtins have no signature: assume no arguments
        return []


def _takes_seed(function: Callable[..., Any]) -> bool:
    return any(p.name == "seed" or p.kind == p.VAR_KEYWORD for p in _parameters(function))


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
        detail = f"it returned {reprlib.repr(result)} ({type(result).__name__}{size})"
    raise ConfigError(
        f"workload {spec!r} must return a gpukit.workloads.Workload or a (model, dataset, loss) "
        f"tuple, but {detail}"
    )


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
]
