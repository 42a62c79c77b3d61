"""What a checkpoint can hold: plain data, which ``torch.load(weights_only=True)`` reads back
(so that loading a checkpoint never runs code), and the state of an object as it is saved.

>>> not_plain({"best": 0.5, "history": [1, 2]}), not_plain({"fn": len})
(None, "['fn'] is a builtin_function_or_method")
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from gpukit._util.text import type_name

# What torch.load(weights_only=True) reads back besides containers.
_LEAVES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, torch.Tensor)
_LEAVES += (torch.Size, torch.dtype, torch.device)
# Dict keys it reads back.
_KEYS = (str, int, float, bool, type(None), tuple)


def saved_state(obj: Any) -> Any:
    """``obj.state_dict()`` without the object's own bound methods (older torch keeps
    OneCycleLR's ``anneal_func`` in it): the constructor makes them again, so they are not
    state."""
    state = obj.state_dict()
    if isinstance(state, dict):
        own = [k for k, v in state.items() if getattr(v, "__self__", None) is obj]
        state = {k: v for k, v in state.items() if k not in own} if own else state
    return state


def not_plain(value: Any, path: str = "") -> str | None:
    """Where ``value`` holds something ``torch.load(weights_only=True)`` refuses, or None.
    Plain data only: dicts with plain keys, lists and tuples (no namedtuples or dataclasses),
    and leaves; a container met twice (shared, or a cycle) is looked at once.

    >>> not_plain({"best": 0.5, "history": [1, 2]}) is None
    True
    >>> not_plain({"fn": print})
    "['fn'] is a builtin_function_or_method"
    """
    pending: list[tuple[str, Any]] = [(path, value)]
    seen: set[int] = set()
    while pending:
        where, item = pending.pop()
        if isinstance(item, (dict, OrderedDict)) or type(item) in (list, tuple):
            if id(item) in seen:
                continue
            seen.add(id(item))
            pairs = list(item.items()) if isinstance(item, dict) else list(enumerate(item))
            for key, _ in pairs:
                if isinstance(item, dict) and not isinstance(key, _KEYS):
                    return f"key {key!r} at {where or 'the top'} is a {type_name(key)}"
            pending.extend(reversed([(f"{where}[{key!r}]", v) for key, v in pairs]))
        elif not isinstance(item, _LEAVES):
            return f"{where or 'value'} is a {type_name(item)}"
    return None
