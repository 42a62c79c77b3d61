"""Measuring a model of N identical blocks through a few of them.

A transformer is mostly N copies of one block, and what each copy saves for the backward is
the same. :func:`repeated_blocks` finds such blocks (one class, the same parameter and buffer
shapes, dtypes and settings in every module of each; an attribute naming the block's own
position, such as ``layer_idx``, may differ); :func:`truncated` runs the model with only its
first ``MEASURED`` blocks; :func:`stretch` then lays out what the whole model saves: what comes
before the blocks, the first block (which may count tensors the later ones share), the middle
block repeated, the last block and what comes after. It first checks that the measured middle
blocks saved the same tensors (a block that behaves differently by position, every other one
say, does not pass), and returns None when they did not, so that the whole model is measured.

>>> from torch import nn
>>> model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(8)])
>>> container, blocks = repeated_blocks(model)
>>> container is model, len(blocks)
(True, 8)
>>> with truncated(container, 2):
...     len(model)
2
>>> len(model)
8
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from torch import nn

from gpukit.strategies._groups import find_blocks

# The blocks a truncated model keeps: the first (it may differ), two middle ones to compare,
# and the last.
MEASURED = 4

# An attribute that names a block's own position, which may differ between identical blocks.
_POSITION = re.compile(r"(^|_)(idx|index|id|number|num)$")

T = TypeVar("T")


def repeated_blocks(model: nn.Module) -> tuple[nn.Module, list[nn.Module]] | None:
    """The container of ``model``'s blocks (:func:`find_blocks`) and the blocks, when they are
    more than ``MEASURED`` identical blocks (see the module doc), distinct and sharing no
    parameter; else None."""
    found = find_blocks(model)
    if found is None or len(found[1]) <= MEASURED:
        return None
    name, blocks = found
    if len({id(b) for b in blocks}) != len(blocks):
        return None
    owned = [id(p) for b in blocks for p in b.parameters()]
    if len(set(owned)) != len(owned):
        return None
    first = _signature(blocks[0])
    if any(_signature(b) != first for b in blocks[1:]):
        return None
    return model.get_submodule(name), blocks


def _signature(block: nn.Module) -> list[Any]:
    out: list[Any] = []
    for name, module in block.named_modules():
        tensors = [
            (n, tuple(t.shape), t.dtype, t.requires_grad)
            for n, t in [*module._parameters.items(), *module._buffers.items()]
            if t is not None
        ]
        plain = sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if not k.startswith("_")
            and not _POSITION.search(k)
            and isinstance(v, (bool, int, float, str, tuple, type(None)))
        )
        out.append((name, type(module), tensors, plain))
    return out


@contextmanager
def truncated(container: nn.Module, keep: int) -> Iterator[None]:
    """``container`` (a ``ModuleList`` or ``Sequential``) holding only its first ``keep``
    modules while inside; the model is restored on leaving, whatever happened."""
    whole = container._modules
    container._modules = dict(list(whole.items())[:keep])
    try:
        yield
    finally:
        container._modules = whole


def stretch(
    saved: Sequence[T],
    block: Callable[[T], int],
    entered: Callable[[T], int],
    key: Callable[[T], Any],
    total: int,
) -> list[tuple[T, int]] | None:
    """What a forward through ``total`` blocks saves, from ``saved`` in the order a forward
    through the first ``MEASURED`` of them saved it: each item with its block (-1 outside
    any), or None when the middle blocks differ. ``block(item)``: the block that saved it (-1:
    none); ``entered(item)``: how many blocks the forward had entered by then; ``key(item)``:
    what must be equal for two blocks to count as saving the same."""
    inside: list[list[T]] = [[] for _ in range(MEASURED)]
    after: list[list[T]] = [[] for _ in range(MEASURED + 1)]  # after[0]: before the blocks
    for item in saved:
        b = block(item)
        if b >= 0:
            inside[b].append(item)
        else:
            after[entered(item)].append(item)
    middle = [[key(i) for i in part] for part in inside[1:]]
    if any(m != middle[0] for m in middle[1:]):
        return None
    if [key(i) for i in after[2]] != [key(i) for i in after[3]]:
        return None
    out = [(i, -1) for i in after[0]]
    out += [(i, 0) for i in inside[0]] + [(i, -1) for i in after[1]]
    for b in range(1, total - 1):
        out += [(i, b) for i in inside[1]] + [(i, -1) for i in after[2]]
    last = MEASURED - 1
    out += [(i, total - 1) for i in inside[last]] + [(i, -1) for i in after[last + 1]]
    return out
