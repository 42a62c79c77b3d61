"""Sharded tensors used where plain ones were expected, in words: torch's DTensor refuses an
operation that mixes a sharded parameter (fsdp, tensor parallel) with a plain tensor (see
``gpukit.diagnostics.readable``)."""

from __future__ import annotations

import re

from gpukit._util.text import explained as _say
from gpukit.errors import GpukitError, ShardedTensorError

_MIXED = re.compile(r"(?:aten\.)?([\w.]+?)(?:\.default)? got mixed torch\.Tensor and DTensor")


def mixed_dtensor(text: str) -> GpukitError | None:
    """A :class:`~gpukit.errors.ShardedTensorError` for torch's "got mixed torch.Tensor and
    DTensor" message, or None for any other.

    >>> print(str(mixed_dtensor("aten.mm.default got mixed torch.Tensor and DTensor, need to "
    ...     "convert all torch.Tensor to DTensor before calling distributed operators!"))
    ...     .splitlines()[0])
    a sharded parameter was used outside its module: mm got a DTensor and a plain tensor
    """
    found = _MIXED.search(text)
    if found is None:
        return None
    return ShardedTensorError(
        _say(
            f"a sharded parameter was used outside its module: {found[1]} got a DTensor and "
            "a plain tensor",
            "under fsdp (or tensor parallel) each parameter is a DTensor holding only this "
            "rank's shard; its module gathers the full weight just for its own forward. "
            "Using the parameter anywhere else (model.head.weight in the loss, a weight shared "
            "by hand between modules, a parameter read after setup) meets a shard, not the "
            "weight",
            [
                "compute with the parameter inside the forward of the module that owns it "
                "(call the module, not its .weight)",
                "tie weights by assigning the same nn.Parameter to both modules before "
                "rt.setup: gpukit then shards them in one group",
                "for reading the weights, use rt.full_state_dict() (full tensors on rank 0)",
            ],
        )
    )
