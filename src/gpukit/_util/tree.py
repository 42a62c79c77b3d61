"""The one walker of nested data: tensors inside dicts, Mappings, lists, tuples, namedtuples and
dataclasses, as batches, model outputs and optimizer states hold them.

Every part of gpukit that looks inside such data (moving it to a device, cutting a batch, the
loader's stream bookkeeping, memory and placement reports, the op log, the trace) walks it
here, so they all agree on what a container is and what a leaf is:

- ``torch.Tensor`` is a leaf (and so is any other type passed as ``leaf=``);
- a namedtuple, list or tuple (or a subclass) is walked in order and rebuilt as its own type;
- a Mapping is walked by its values; a ``dict`` subclass is rebuilt as a copy of itself (a
  ``defaultdict`` keeps its factory; one that refuses ``update``, as a ``transformers`` model's
  output does, is refilled key by key), another Mapping through its constructor, else a dict;
- a dataclass instance is walked by its fields and rebuilt as a copy (frozen ones and fields
  with ``init=False`` too);
- anything else (strings, numbers, None) is passed through.

A tensor found twice is mapped once: aliases stay aliases after a move. Data that holds itself
(a list that contains itself) or is nested deeper than Python's recursion limit cannot be
walked: it raises a :class:`~gpukit.errors.ConfigError` naming the path of the cycle, found
only once the walk has failed, so the usual walk pays nothing for the check. A container whose
own methods raise is a ConfigError too; what the function mapped over the tensors raises passes
through unchanged.

>>> import torch
>>> batch = {"x": torch.zeros(2), "meta": ("a", [torch.ones(1)])}
>>> [t.shape[0] for t in tensors(batch)]
[2, 1]
>>> map_tensors(batch, lambda t: t + 1)["meta"][1][0]
tensor([2.])
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from gpukit._util.text import safe_repr
from gpukit.errors import ConfigError, GpukitError

# How many values the search for a cycle looks at before it gives up and reports the depth.
_SEARCH_LIMIT = 1_000_000


def is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def children(obj: Any) -> Iterator[tuple[str, Any]]:
    """The (name, value) pairs directly inside a container; nothing for a leaf or a plain value.
    Names read as paths: ``[0]`` for sequences, ``.key`` for mappings, namedtuples and
    dataclasses."""
    if isinstance(obj, torch.Tensor):
        return
    if is_namedtuple(obj):
        for name, value in zip(obj._fields, obj, strict=True):
            yield f".{name}", value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield f".{key}", value
    elif is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            yield f".{f.name}", getattr(obj, f.name)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in order (a tensor found twice comes twice).

    >>> import torch
    >>> len(list(tensors([torch.zeros(1), {"a": torch.zeros(1)}, "text"])))
    2
    """
    try:
        yield from _tensors(obj)
    except RecursionError:
        raise unwalkable(obj) from None
    except GpukitError:
        raise
    except Exception as err:  # only containers run code here: one of them failed
        raise unreadable(obj, err) from err


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    for _, value in children(obj):
        yield from _tensors(value)


def leaves(obj: Any, leaf: type | tuple[type, ...]) -> list[tuple[str, Any]]:
    """Every leaf (an instance of ``leaf``) inside ``obj`` with its path (``data[0].x``),
    depth first, in the order :func:`map_tensors` visits them with ``alias=False``.

    >>> [path for path, _ in leaves({"x": [1, 2.5], "y": "text"}, (int, float))]
    ['data.x[0]', 'data.x[1]']
    """
    found: list[tuple[str, Any]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, leaf):
            found.append((path, value))
            return
        for name, child in children(value):
            walk(child, path + name)

    try:
        walk(obj, "data")
    except RecursionError:
        raise unwalkable(obj) from None
    except GpukitError:
        raise
    except Exception as err:
        raise unreadable(obj, err) from err
    return found


def map_tensors(
    obj: Any,
    fn: Callable[[Any], Any],
    leaf: type | tuple[type, ...] = torch.Tensor,
    alias: bool = True,
) -> Any:
    """``obj`` rebuilt with ``fn`` applied to every leaf (tensors, or the types in ``leaf``);
    containers keep their types, and a leaf found twice is mapped once (``alias=False``: at
    each place it is found, as numbers, which Python shares between places, need)."""
    memo: dict[int, Any] = {}
    failed: list[BaseException] = []  # what ``fn`` raised, which passes through as it is

    def walk(value: Any) -> Any:
        if isinstance(value, leaf):
            key = id(value) if alias else len(memo)
            if key not in memo:
                try:
                    memo[key] = fn(value)
                except BaseException as err:
                    failed.append(err)
                    raise
            return memo[key]
        return _rebuild(value, walk)

    try:
        return walk(obj)
    except RecursionError:
        raise unwalkable(obj) from None
    except GpukitError:
        raise
    except Exception as err:
        if failed and failed[-1] is err:
            raise
        raise unreadable(obj, err) from err
    finally:
        # ``walk`` refers to itself (it recurses), a reference cycle that only the garbage
        # collector frees: without this the memo would keep every mapped tensor (a batch
        # moved to the device) alive until a collection runs, at a moment no one chose.
        memo.clear()
        walk = None  # type: ignore[assignment]


def zip_map(objs: Sequence[Any], fn: Callable[[list[torch.Tensor]], Any]) -> Any:
    """Structures of one shape combined: ``fn`` gets the tensors found at one place in all of
    them; values that are not tensors are taken from the first structure.

    >>> import torch
    >>> zip_map([(torch.ones(1), "a"), (torch.ones(1), "b")], torch.cat)
    (tensor([1., 1.]), 'a')
    """
    try:
        return _zip_map(objs, fn)
    except RecursionError:
        raise unwalkable(objs[0]) from None


def _zip_map(objs: Sequence[Any], fn: Callable[[list[torch.Tensor]], Any]) -> Any:
    first = objs[0]
    if isinstance(first, torch.Tensor):
        return fn(list(objs))
    columns: Iterator[Sequence[Any]]
    if isinstance(first, (list, tuple)):
        columns = iter(list(zip(*objs, strict=True)))
    elif isinstance(first, Mapping):
        columns = iter([[o[k] for o in objs] for k in first])
    elif is_dataclass_instance(first):
        columns = iter([[getattr(o, f.name) for o in objs] for f in dataclasses.fields(first)])
    else:
        return first
    return _rebuild(first, lambda _: _zip_map(next(columns), fn))


def unwalkable(obj: Any) -> ConfigError:
    """The error for data the walk could not finish: the path of a cycle in it (a container
    that holds itself), else how deep it is nested. Called after a RecursionError, so the
    search here is iterative.

    >>> loop = [1]
    >>> loop.append(loop)
    >>> print(unwalkable(loop))  # doctest: +ELLIPSIS
    the data holds itself: data[1] is data again (a cycle), so ...
    """
    root = "data"
    on_path: dict[int, str] = {id(obj): root}
    stack: list[tuple[Any, str, Iterator[tuple[str, Any]]]] = [(obj, root, children(obj))]
    deepest, deepest_path, looked = 1, root, 0
    while stack and looked < _SEARCH_LIMIT:
        value, path, inside = stack[-1]
        step = next(inside, None)
        if step is None:
            stack.pop()
            on_path.pop(id(value), None)
            continue
        looked += 1
        name, child = step
        child_path = path + name
        if id(child) in on_path:
            return ConfigError(
                f"the data holds itself: {_cut(child_path)} is {_cut(on_path[id(child)])} again "
                "(a cycle), so walking it never ends: pass data without the cycle, e.g. a copy "
                "that leaves out the reference back"
            )
        on_path[id(child)] = child_path
        stack.append((child, child_path, children(child)))
        if len(stack) > deepest:
            deepest, deepest_path = len(stack), child_path
    return ConfigError(
        f"the data ({safe_repr(obj, 40)}) is nested too deeply to walk: {deepest} levels, down "
        f"to {_cut(deepest_path)}: pass tensors in a few levels of lists, tuples and dicts"
    )


def unreadable(obj: Any, err: BaseException) -> ConfigError:
    """The error for data one of whose containers failed as it was read (its ``__iter__``,
    ``__len__``, ``items()`` or ``__getitem__`` raised).

    >>> print(unreadable([1], KeyError("k")))  # doctest: +ELLIPSIS
    reading the data ([1]) failed with KeyError: 'k': one of its containers raised ...
    """
    try:
        text = str(err).strip().splitlines()[0]
    except Exception:  # an exception whose own message fails
        text = ""
    return ConfigError(
        f"reading the data ({safe_repr(obj, 40)}) failed with {type(err).__name__}"
        f"{': ' + text if text else ''}: one of its containers raised while it was walked; "
        "pass the tensors in plain lists, tuples, dicts or dataclasses"
    )


def _cut(path: str, limit: int = 60) -> str:
    return path if len(path) <= limit else f"{path[: limit - 3]}..."


def _rebuild(obj: Any, walk: Callable[[Any], Any]) -> Any:
    """``obj`` with ``walk`` applied to each value directly inside it, as its own type."""
    if is_namedtuple(obj):
        return type(obj)(*(walk(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        items = [walk(v) for v in obj]
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, Mapping):
        return _same_mapping(obj, {k: walk(v) for k, v in obj.items()})
    if is_dataclass_instance(obj):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            # object.__setattr__ also works on frozen dataclasses, and skips __init__, so
            # fields with init=False survive.
            object.__setattr__(out, f.name, walk(getattr(obj, f.name)))
        return out
    return obj


def _same_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Any:
    """A mapping like ``original`` holding ``items``: a dict subclass is copied and refilled
    (a defaultdict keeps its factory), another Mapping is rebuilt by its constructor, else a
    plain dict holds them."""
    if type(original) is dict:
        return items
    if isinstance(original, dict):
        out = copy.copy(original)
        try:
            out.update(items)
        except Exception:  # a dict subclass that refuses update(): transformers' ModelOutput
            for key, value in items.items():
                out[key] = value
        return out
    with contextlib.suppress(TypeError):
        return type(original)(items)  # type: ignore[call-arg]
    if isinstance(original, MutableMapping):
        rebuilt = copy.copy(original)
        rebuilt.clear()
        rebuilt.update(items)
        return rebuilt
    return items
