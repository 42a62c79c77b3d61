"""``save_pretrained`` of a Hugging Face ``transformers`` model sharded by fsdp.

fsdp shards the model in place: its parameters are DTensors, each rank holding a slice. The
model's own ``save_pretrained`` hands ``self.state_dict()`` to safetensors, which cannot read a
DTensor (``RuntimeError: Attempted to access the data pointer on an invalid python storage``).
So when fsdp sets up a ``transformers`` model, the model's ``save_pretrained`` is replaced, on
that instance only, by one that first gathers the full weights on rank 0 (every rank gives its
shards) and then calls the original with them there: ``rt.unwrap(model).save_pretrained(dir)``
(or ``model.save_pretrained(dir)``) writes the usual Hugging Face folder (config, safetensors,
an index when sharded by ``max_shard_size``), which ``from_pretrained`` loads as it would any.

Collective: every rank calls it, as with Accelerate. Called on rank 0 only (under
``if rt.is_main``) it fails within a short timeout naming the ranks that did not come. A tied
weight (``lm_head.weight`` tied to the input embedding) is written once, as ``transformers``
writes it for an unsharded model.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gpukit.errors import ConfigError
from gpukit.strategies._fsdp_api import is_dtensor
from gpukit.strategies._groups import tied_names
from gpukit.strategies.float8 import plain_weight


def is_transformers_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` ``PreTrainedModel`` (checked by class, without
    importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    )


def gather_on_save(module: nn.Module, strategy: Any) -> None:
    """Give ``module`` (a sharded ``transformers`` model) a ``save_pretrained`` that writes its
    full weights from rank 0 (see the module docstring); nothing for any other model."""
    if not is_transformers_model(module) or "save_pretrained" in vars(module):
        return
    original: Callable[..., Any] = module.save_pretrained  # type: ignore[assignment]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(*args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(*args, **kwargs).arguments.get("state_dict")
        if given is not None:
            if any(is_dtensor(v) for v in given.values()):
                raise ConfigError(
                    "save_pretrained(state_dict=...) got sharded tensors (DTensors, each rank's "
                    "slice: the model's own state_dict() under fsdp), which safetensors cannot "
                    "write: call save_pretrained(dir) without state_dict on every rank (gpukit "
                    "gathers the full weights on rank 0), or pass rt.full_state_dict()"
                )
            return original(*args, **kwargs)
        strategy.check_every_rank_calls("save_pretrained")
        full = full_weights(module)
        result, error = None, None
        if strategy.rank == 0:
            try:
                result = original(*args, **{**kwargs, "state_dict": full})
            except Exception as err:  # every rank raises it below
                error = err
        said = strategy.all_gather_object(None if error is None else f"{error}")
        if error is not None:
            raise error
        failed = next((s for s in said if s is not None), None)
        if failed is not None:
            raise ConfigError(f"save_pretrained failed on rank 0: {failed}")
        return result

    # On this instance only (its __dict__): the class, and every other model, stay as they are.
    vars(module)["save_pretrained"] = save_pretrained


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full weights of a sharded ``module`` as CPU tensors on rank 0 ({} elsewhere), a
    tied weight one tensor under each of its names (as ``state_dict`` gives it unsharded, so
    that ``transformers`` writes it once). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = {  # plain tensors: safetensors cannot write torchao's float8 weight wrapper
        k: plain_weight(v)
        for k, v in get_model_state_dict(module, options=options).items()
        if isinstance(v, torch.Tensor)
    }
    if not full:
        return full
    for names in tied_names(module):
        kept = next((full[n] for n in names if n in full), None)
        if kept is not None:
            full.update(dict.fromkeys(names, kept))
    return full
