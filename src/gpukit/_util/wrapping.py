"""How gpukit's own wrappers of a user's model (autocast, dp's devices) pickle: as the model.

A wrapper says how this process runs the model; it is no part of the model. ``torch.save(model,
f)`` of what ``rt.setup`` returned must write the program's own model, as the program did
before it used gpukit, into a file that loads where gpukit is not installed.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import nn


def pickled_as_model(model: nn.Module) -> tuple[Any, ...]:
    """What a wrapper's ``__reduce_ex__`` returns to be pickled as the ``model`` it holds.

    A wrapper says how this process runs the model (autocast, devices); it is no part of the
    model, and a file holding its class would need gpukit to load. This hands pickle the model
    itself, so the file holds the user's class, the same objects as ``torch.save(model, f)``
    of the bare model, and loads where gpukit is not installed. The one thing added is the
    function that picks it out again, ``operator.getitem`` (from the standard library): a
    model shared with other objects in the same file stays one object after loading, which
    rebuilding a copy of it here would break. (``torch.load(f, weights_only=True)`` of a whole
    model needs the model's classes allowed, ``torch.serialization.add_safe_globals``; with
    this, ``operator.getitem`` too.)

    >>> import pickle, torch
    >>> class Wrapper(torch.nn.Module):
    ...     def __init__(self, module):
    ...         super().__init__()
    ...         self.module = module
    ...     def __reduce_ex__(self, protocol):
    ...         return pickled_as_model(self.module)
    >>> type(pickle.loads(pickle.dumps(Wrapper(torch.nn.Linear(2, 2))))).__name__
    'Linear'
    """
    # operator.getitem((model,), 0) is the model: pickle saves the tuple's one item through
    # its own memo, so every reference to the model in the file loads as one object.
    return operator.getitem, ((model,), 0)
