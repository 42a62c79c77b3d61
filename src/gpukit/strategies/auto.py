"""fsdp in place of the ddp that ``strategy="auto"`` picked, for a model ddp cannot hold.

The two share their processes: fsdp is ddp's subclass (the same ranks, process group, data
sharding and collectives); only the model's placement differs. So an ``"auto"`` ddp whose model
turns out too large becomes an fsdp with its defaults over the same devices, taking over the
process group the ddp joined (see ``gpukit.runtime.strategy_at_setup``).

>>> from gpukit.devices import device
>>> ddp = DDP()
>>> ddp.configure([device("cpu"), device("cpu")])
>>> replaceable(ddp), fsdp_in_place_of(ddp, ready=False).world_size
(True, 2)
"""

from __future__ import annotations

from gpukit.strategies.base import Strategy
from gpukit.strategies.ddp import DDP
from gpukit.strategies.fsdp import FSDP

# What "auto" picks over several ranks, and what it may take instead (the planner compares them).
REPLICATED, SHARDED = DDP.name, FSDP.name


def replaceable(strategy: Strategy) -> bool:
    """Whether ``strategy`` is a plain ddp over several ranks (what ``"auto"`` makes there)."""
    return type(strategy) is DDP and strategy.world_size > 1


def fsdp_in_place_of(ddp: Strategy, *, ready: bool) -> FSDP:
    """An fsdp with its defaults over ``ddp``'s devices and ranks (``ddp``: one that
    :func:`replaceable` accepts); ``ready``: ddp's process environment is set up (then fsdp
    takes its process group over and makes its mesh, every rank together, and ddp keeps
    nothing to tear down)."""
    assert isinstance(ddp, DDP), "only a ddp is replaced"
    fsdp = FSDP(timeout=ddp.timeout)
    fsdp.configure(list(ddp.devices))
    fsdp.meta_init = ddp.meta_init
    if ready:
        ddp.hand_over(fsdp)
    return fsdp
