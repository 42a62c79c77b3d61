"""Checks of arguments that several rooms share, each raising a
:class:`~gpukit.errors.ConfigError` that says what was given and what to pass instead.

>>> import torch
>>> require_module(torch.nn.Linear(2, 2), "rt.setup")
Linear(in_features=2, out_features=2, bias=True)
>>> require_module(None, "rt.setup")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
gpukit.errors.ConfigError: rt.setup got None where the model goes: ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpukit._util.text import described, type_name
from gpukit.errors import ConfigError


def require_module(module: Any, where: str, meta: bool = False) -> nn.Module:
    """``module`` itself when it is an ``nn.Module`` whose tensors hold data; else the error
    that says so (reads only metadata: this runs once per model, at setup). ``meta``: a model
    on the meta device is accepted (the strategy materialises it)."""
    if isinstance(module, type) and issubclass(module, nn.Module):
        raise ConfigError(
            f"{where} got the class {module.__name__}, not a model: build it first, e.g. "
            f"{where}({module.__name__}(...), optimizer)"
        )
    if isinstance(module, torch.optim.Optimizer):
        raise ConfigError(
            f"{where} got the optimizer ({type_name(module)}) where the model goes: the model "
            f"comes first, then the optimizers and loaders: {where}(model, optimizer, loader)"
        )
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"{where} got {described(module)} where the model goes: pass a torch.nn.Module, "
            f"e.g. {where}(model, optimizer, loader)"
        )
    found = None if meta else next((n for n, t in _named_tensors(module) if t.is_meta), None)
    if found is not None:
        raise ConfigError(
            f"{where}: the model's {found} is on the meta device: it has a shape but no data, "
            "so it cannot be moved. Materialise it first (model.to_empty(device=...), then "
            "load or initialise the weights)"
        )
    return module


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]
