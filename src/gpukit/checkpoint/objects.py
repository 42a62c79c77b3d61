"""What ``state.pt`` holds besides the weights, the optimizer states and the progress: each
optimizer's class and parameter-group keys, the learning-rate schedulers, the other objects
``rt.setup`` was given (a gradient scaler), and what ``rt.track`` registered.

A load checks that the checkpoint holds exactly what the run has (the same classes, the same
names) before anything changes, and a checkpoint written before these entries existed loads
only into a run that has none of them (then nothing is missing).

>>> import types
>>> state = types.SimpleNamespace(optimizers=[], schedulers=[], objects=[])
>>> state.tracked = {"stats": {"best": 1.0}}
>>> saved = entries(state)
>>> saved["tracked"]
{'stats': {'type': 'builtins.dict', 'state': {'best': 1.0}}}
>>> state.tracked["stats"]["best"] = 0.5; restore(saved, state); state.tracked["stats"]
{'best': 1.0}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gpukit._util.tree import tensors
from gpukit.checkpoint.live import RunState
from gpukit.checkpoint.plain import not_plain, saved_state
from gpukit.errors import ConfigError

_KINDS = ("schedulers", "objects")


def entries(state: RunState) -> dict[str, Any]:
    """The entries of ``state.pt`` for ``state`` (every rank computes them: a problem is
    raised on every rank alike, before a file is written)."""
    saved: dict[str, Any] = {
        "optimizer_types": [_type(o) for o in state.optimizers],
        "optimizer_groups": [_group_keys(o.param_groups) for o in state.optimizers],
        "schedulers": [
            {
                "type": _type(s.scheduler),
                "state": saved_state(s.scheduler),
                "owed": s.owed(),
                "per_step": s.per_step,
            }
            for s in state.schedulers
        ],
        "objects": [{"type": _type(o), "state": saved_state(o)} for o in state.objects],
        "tracked": {
            name: {"type": _type(o), "state": dict(o) if type(o) is dict else saved_state(o)}
            for name, o in state.tracked.items()
        },
    }
    problem = not_plain({k: saved[k] for k in ("schedulers", "objects", "tracked")})
    if problem is not None:
        raise ConfigError(
            f"cannot save a checkpoint: {problem}, which a checkpoint cannot hold as plain "
            "data (it loads with weights_only=True, so that it never runs code); nothing was "
            "written. Keep only numbers, strings, lists, dicts and tensors in tracked dicts and "
            "in the state of what rt.setup was given"
        )
    return saved


def mismatches(saved: dict[str, Any], state: RunState) -> list[str]:
    """Whether the checkpoint's entries are what ``state`` has: one line per difference."""
    found = _optimizer_mismatches(saved, state.optimizers)
    live = {
        "schedulers": [s.scheduler for s in state.schedulers],
        "objects": state.objects,
    }
    for kind in _KINDS:
        found += _list_mismatches(kind, saved.get(kind), live[kind])
    kept, names = saved.get("tracked"), sorted(state.tracked)
    if kept is None:
        if names:
            found.append(
                f"the checkpoint holds no tracked state (it was written before rt.track "
                f"existed, or without it), and this run tracks {', '.join(names)}"
            )
        return found
    if not isinstance(kept, dict) or sorted(kept) != names:
        held = ", ".join(sorted(kept)) if isinstance(kept, dict) else "something else"
        found.append(
            f"tracked state: the checkpoint holds {held or 'none'}, this run tracks "
            f"{', '.join(names) or 'none'} (rt.track the same names as the saved run)"
        )
        return found
    for name in names:
        entry, obj = kept[name], state.tracked[name]
        found += _entry_mismatches(f"tracked {name!r}", entry, obj)
    return found


def restore(saved: dict[str, Any], state: RunState) -> None:
    """Load the entries into ``state``'s objects (after the optimizers: a scheduler's owed
    steps set their learning rates)."""
    for scheduler, entry in zip(state.schedulers, saved.get("schedulers", []), strict=False):
        scheduler.load_state_dict(dict(entry["state"]))
    for obj, entry in zip(state.objects, saved.get("objects", []), strict=False):
        obj.load_state_dict(entry["state"])
    for name, obj in state.tracked.items():
        kept = saved["tracked"][name]["state"]
        if type(obj) is dict:
            _fill(obj, kept)
        else:
            obj.load_state_dict(kept)
    for scheduler, entry in zip(state.schedulers, saved.get("schedulers", []), strict=False):
        scheduler.settle(int(entry.get("owed", 0)), entry.get("per_step"))


def _optimizer_mismatches(saved: dict[str, Any], optimizers: Sequence[Any]) -> list[str]:
    types = saved.get("optimizer_types")
    groups = saved.get("optimizer_groups")
    if groups is None:  # written before the keys were kept: the full layout has them
        kept = saved.get("optimizers", [])
        if all(isinstance(o, dict) and "param_groups" in o for o in kept):
            groups = [_group_keys(o["param_groups"]) for o in kept]
    found: list[str] = []
    for i, optimizer in enumerate(optimizers):
        label = f"optimizer {i}" if len(optimizers) > 1 else "optimizer"
        now = _type(optimizer)
        if isinstance(types, list) and i < len(types) and types[i] != now:
            found.append(
                f"{label}: the checkpoint's is {types[i]}, this run's is {now} (build the "
                "optimizer the saved run used)"
            )
            continue
        if not isinstance(groups, list) or i >= len(groups):
            continue
        live_groups = _group_keys(optimizer.param_groups)
        for g, (keys, live) in enumerate(zip(groups[i], live_groups, strict=False)):
            extra = sorted(set(keys) - set(live))
            # Keys this torch's optimizer has and the saved one lacked are its newer settings,
            # which the optimizer's own loading fills with their defaults.
            missing = sorted(set(live) - set(keys) - set(optimizer.defaults))
            if extra or missing:
                parts = [f"the checkpoint's has {', '.join(extra)}"] * bool(extra)
                parts += [f"this run's has {', '.join(missing)}"] * bool(missing)
                found.append(
                    f"{label} ({now}) parameter group {g}: different keys ({'; '.join(parts)}): "
                    "build the optimizer and its groups as the saved run did"
                )
    return found


def _list_mismatches(kind: str, kept: Any, live: Sequence[Any]) -> list[str]:
    what = kind[:-1]  # "scheduler", "object"
    if kept is None:
        if not live:
            return []
        return [
            f"the checkpoint holds no {what} state (it was written before gpukit saved "
            f"{kind}), and this run has {len(live)} ({', '.join(_type(o) for o in live)})"
        ]
    if not isinstance(kept, list) or len(kept) != len(live):
        held = (
            [e.get("type", "?") for e in kept if isinstance(e, dict)]
            if isinstance(kept, list)
            else []
        )
        return [
            f"{len(held)} {what}(s) in the checkpoint ({', '.join(held) or 'none'}), "
            f"{len(live)} now ({', '.join(_type(o) for o in live) or 'none'}): give rt.setup the "
            f"same {kind} as the saved run"
        ]
    found: list[str] = []
    for i, (entry, obj) in enumerate(zip(kept, live, strict=True)):
        found += _entry_mismatches(f"{what} {i}", entry, obj)
    return found


def _entry_mismatches(label: str, entry: Any, obj: Any) -> list[str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("state"), dict):
        return [f"{label}: its saved state is not what gpukit writes"]
    if entry.get("type") != _type(obj):
        return [f"{label}: the checkpoint's is {entry.get('type')}, this run's is {_type(obj)}"]
    return []


def _fill(live: dict[Any, Any], kept: dict[Any, Any]) -> None:
    """``live`` (a tracked dict) becomes ``kept`` in place, each tensor on the device the live
    entry's tensors were on (a checkpoint is read onto the CPU)."""
    devices = {k: next(tensors(v), None) for k, v in live.items()}
    kept = dict(kept)  # it may be ``live`` itself
    live.clear()
    for key, value in kept.items():
        at = devices.get(key)
        if at is not None and isinstance(value, torch.Tensor):
            value = value.to(at.device)
        live[key] = value


def _type(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _group_keys(groups: list[dict[str, Any]]) -> list[list[str]]:
    return [sorted(k for k in group if k != "params") for group in groups]
