"""What a workload is, and loading one by name: a built-in or ``"package.module:function"``.

>>> w = load_workload("mlp", seed=1)
>>> x, y = w.dataset[0]
>>> w.loss(w.model(x[None]), y[None]).shape
torch.Size([])
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from gpukit._util.text import described, safe_repr, type_name
from gpukit._util.tree import children
from gpukit.errors import ConfigError, GpukitError
from gpukit.runtime.settings_checks import SEED_RANGE

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
    with the trained model on the given device. ``validation``, where set, holds held-out
    ``(input, target)`` items that ``gpukit train`` evaluates at the end of every epoch (its
    ``val_loss``); ``accuracy`` True adds ``val_accuracy``, the share of items whose output's
    argmax over the last dimension is the target (a classifier's).

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
            result = builder(seed=seed) if _takes_seed(builder) else builder()
        except GpukitError:
            raise
        except Exception as err:
            if ":" not in spec:
                raise  # a built-in workload that fails is gpukit's bug: keep its traceback
            module_name, _, function_name = spec.partition(":")
            raise ConfigError(
                f"workload {spec!r}: {function_name}() failed{_failed_at(err, module_name)} "
                f"with {type_name(err)}: {_first_line(err)}: fix it (calling it in Python "
                "shows the whole traceback)"
            ) from err
    workload = _as_workload(spec, result)
    _check_parts(workload, meta=meta)
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
        # Two lines, as Python shows it: where and what, then the line itself.
        where = f"{err.filename}:{err.lineno}" if err.filename else module_name
        line = (err.text or "").strip()
        shown = f"    {line}    <- fix this line and run again" if line else "    fix it, run again"
        raise ConfigError(
            f"workload {spec!r}: {where}: {type_name(err)}: {err.msg}\n{shown}"
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
    try:
        text = str(err).strip()
    except Exception:  # an exception whose own message fails
        text = ""
    return text.splitlines()[0] if text else type_name(err)


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
        detail = f"it returned {safe_repr(result)} ({type_name(result)}{size})"
    raise ConfigError(
        f"workload {spec!r} must return a gpukit.workloads.Workload or a (model, dataset, loss) "
        f"tuple, but {detail}"
    )


def _check_parts(w: Workload, meta: bool = False) -> None:
    """Refuse, before any process starts, a workload that cannot train: a model with nothing
    to train, a dataset that is empty or whose items are not (input, target) pairs."""
    problem = _model_problem(w.model, meta) or _dataset_problem(w.dataset)
    if problem is None and w.validation is not None:
        found = _dataset_problem(w.validation)
        problem = f"its validation set: {found}" if found else None
    if problem is None and not callable(w.loss):
        problem = f"the loss is {described(w.loss)}, not a function loss(output, target)"
    if problem is not None:
        raise ConfigError(f"workload {w.name!r}: {problem}")


def _model_problem(model: object, meta: bool = False) -> str | None:
    if not isinstance(model, nn.Module):
        return f"the model is {described(model)}, not a torch.nn.Module"
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        state = f"{len(params)} parameter(s), all frozen" if params else "no parameters"
        return (
            f"the model ({type_name(model)}) has {state}: there is nothing to train; return "
            "a model with trainable weights (or unfreeze them with requires_grad_(True))"
        )
    if not meta and any(p.is_meta for p in params):
        return (
            f"the model ({type_name(model)}) has parameters on the meta device (a shape, no "
            "data): create it on a real device, or materialise it with to_empty()"
        )
    return None


def _dataset_problem(dataset: object) -> str | None:
    """What is wrong with the dataset, judged from its length and its first item."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return (
            f"the dataset is {described(dataset)}: give a map-style dataset (len() and "
            "dataset[i]), e.g. torch.utils.data.TensorDataset(inputs, targets)"
        )
    data: Any = dataset
    try:
        size = len(data)
        item = data[0] if size > 0 else None
    except Exception as err:
        return (
            f"reading the dataset ({type_name(dataset)}) failed with {type_name(err)}: "
            f"{_first_line(err)}: len(dataset) and dataset[0] must work"
        )
    if size == 0:
        return (
            f"the dataset ({type_name(dataset)}) is empty: there is no batch to train on; "
            "return one with samples"
        )
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        count = f" of {len(item)} items" if isinstance(item, (tuple, list)) else ""
        return (
            f"dataset[0] is {safe_repr(item, 60)} ({type_name(item)}{count}): each item must "
            "be an (input, target) pair, e.g. TensorDataset(inputs, targets)"
        )
    for name, part in zip(("input", "target"), item, strict=True):
        if not _batchable(part):
            return (
                f"dataset[0]'s {name} is {safe_repr(part, 60)} ({type_name(part)}): the "
                f"{name} must be a tensor (or numbers, numpy arrays, or a tuple/dict of "
                "them) for the loader to stack into a batch"
            )
    return None


def _batchable(value: object) -> bool:
    """Whether the default collate stacks ``value`` into a tensor batch: tensors, arrays and
    numbers, also inside a few levels of tuples, lists and dicts (strings and None it cannot
    give to a model)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (torch.Tensor, np.ndarray, np.generic)):
            continue
        if isinstance(item, numbers.Number) and not isinstance(item, complex):
            continue
        inside = [child for _, child in children(item)]
        if not inside or depth >= 3 or isinstance(item, (str, bytes)):
            return False
        stack += [(child, depth + 1) for child in inside]
    return True


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
