"""A user's ``"package.module:function"`` workload: importing its module and finding the
function, each failure told in one line that names the user's file and line (a traceback
through importlib says less than that)."""

from __future__ import annotations

import importlib
import inspect
import os
import traceback
from collections.abc import Callable
from typing import Any

from gpukit._util.text import type_name
from gpukit.errors import ConfigError


def user_function(spec: str, module_name: str, function_name: str) -> Callable[..., Any]:
    """The function ``function_name`` of the user's module ``module_name``, callable with no
    arguments (or ``seed=`` only); ``spec`` is how the user named it, for the messages."""
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
            f"{failed_at(err, module_name)} with {type(err).__name__}: {first_line(err)}: "
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
            f"{failed_at(err, module_name)} with {type(err).__name__}: {first_line(err)}: "
            "fix the module (or move that code into the function)"
        ) from None


def failed_at(err: BaseException, module_name: str) -> str:
    """' (at FILE, line N)': the last line of the user's module the error went through, else
    the line that raised it."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename[:1] != "<"]
    tail = module_name.replace(".", os.sep)
    ends = (tail + ".py", os.path.join(tail, "__init__.py"))
    mine = [f for f in frames if f.filename.endswith(ends)] or frames[-1:]
    return f" (at {mine[-1].filename}, line {mine[-1].lineno})" if mine else ""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, else its type's name."""
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


def takes_seed(function: Callable[..., Any]) -> bool:
    """Whether ``function`` accepts ``seed=``."""
    return any(p.name == "seed" or p.kind == p.VAR_KEYWORD for p in _parameters(function))
