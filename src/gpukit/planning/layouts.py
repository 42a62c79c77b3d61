"""A layout: how a run splits its GPUs over data, tensor, pipeline and context parallelism,
as torchtitan composes them: ``dp_replicate x dp_shard x tp x pp x cp`` GPUs, FSDP over
``dp_shard x cp`` (context-parallel ranks hold different tokens of the same samples, so they
shard the weights like data-parallel ones), tensor parallelism with sequence parallelism inside
a node, pipeline stages outermost, float8 matrix products optionally.

Each size must divide what it splits: ``tp`` the attention heads and key/value heads, ``pp``
(times the stages each rank holds) the blocks, ``cp`` the sequence (in ``2 x cp`` chunks, for
the load-balanced causal ring), and their product the GPUs. :func:`check` says, in one error,
which one does not; :func:`candidates` lists every layout that passes.

>>> from gpukit.planning.layout_shape import TransformerShape
>>> s = TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192)
>>> check(Layout(dp_shard=4, tp=2), s, 8).degrees
{'dp_replicate': 1, 'dp_shard': 4, 'tp': 2, 'pp': 1, 'cp': 1}
>>> len(candidates(s, 8)) > 10
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpukit.errors import ConfigError
from gpukit.planning.layout_shape import TransformerShape

# torch.distributed.pipelining's schedules the planner models, by the names torchtitan's
# --parallelism.pipeline_parallel_schedule takes, with the stages each rank holds (the "v" of
# interleaving: torchtitan's default of 2 for the looped ones).
SCHEDULES: dict[str, int] = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "InterleavedZeroBubble": 2,
}
FLOAT8 = ("tensorwise", "rowwise")
# GPUs one NVLink domain joins: tensor parallelism communicates every block, so it stays there.
GPUS_PER_NODE = 8
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp", "cp")


@dataclass(frozen=True)
class Layout:
    """How many ways each dimension splits (see the module doc). ``pp_schedule``: one of
    :data:`SCHEDULES`; ``microbatches``: per pipeline step (None: ``pp`` as torchtitan's
    default, or the local batch where that is less); ``float8``: None, "tensorwise" (weights
    gathered in float8 too) or "rowwise"; ``async_tp``: tensor parallelism's collectives
    overlapped with its matrix products (torchtitan's AsyncTP)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    pp_schedule: str = "1F1B"
    microbatches: int | None = None
    float8: str | None = None
    async_tp: bool = False

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """Ways FSDP shards each weight: over ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def data_parallel(self) -> int:
        """Ways the batch is split (replicas times shards)."""
        return self.dp_replicate * self.dp_shard

    @property
    def stages_per_rank(self) -> int:
        return SCHEDULES[self.pp_schedule] if self.pp > 1 else 1

    @property
    def degrees(self) -> dict[str, int]:
        """The five sizes, by name (what ``choose_layout`` returns)."""
        return {name: int(getattr(self, name)) for name in DEGREES}

    def describe(self) -> str:
        """The sizes above 1, as ``tp 8 x pp 4 x dp_shard 16`` (and the schedule, float8).

        >>> Layout(dp_shard=16, tp=8, pp=4, pp_schedule="Interleaved1F1B").describe()
        'tp 8 x pp 4 (Interleaved1F1B) x dp_shard 16'
        """
        parts = []
        for name in ("tp", "pp", "cp", "dp_shard", "dp_replicate"):
            size = getattr(self, name)
            if size > 1:
                schedule = f" ({self.pp_schedule})" if name == "pp" else ""
                parts.append(f"{name} {size}{schedule}")
        text = " x ".join(parts) or "1 GPU"
        extras = [f"float8 {self.float8}"] if self.float8 else []
        extras += ["async TP"] if self.async_tp and self.tp > 1 else []
        return text + (f", {', '.join(extras)}" if extras else "")


def microbatches(layout: Layout, local_batch: int) -> int:
    """The micro-batches a pipeline step splits ``local_batch`` into (1 without pipeline)."""
    if layout.pp == 1:
        return 1
    return layout.microbatches or min(layout.pp, local_batch)


def check(
    layout: Layout,
    shape: TransformerShape,
    gpus: int,
    *,
    local_batch: int = 1,
    gpus_per_node: int = GPUS_PER_NODE,
) -> Layout:
    """``layout``, checked against ``shape`` and ``gpus`` (see the module doc); the first
    thing that does not divide is a :class:`~gpukit.errors.ConfigError` naming it."""
    for name in DEGREES:
        value = getattr(layout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: give a whole number of GPUs, at least 1")
    if layout.pp_schedule not in SCHEDULES:
        raise ConfigError(
            f"pp_schedule={layout.pp_schedule!r}: choose among {', '.join(SCHEDULES)}"
        )
    if layout.float8 is not None and layout.float8 not in FLOAT8:
        raise ConfigError(
            f"float8={layout.float8!r}: choose among {', '.join(FLOAT8)}, or None for bf16"
        )
    sizes = " x ".join(f"{n} {getattr(layout, n)}" for n in DEGREES)
    if layout.gpus != gpus:
        raise ConfigError(
            f"{sizes} is {layout.gpus} GPUs, not the {gpus} planned: make the product of "
            "dp_replicate, dp_shard, tp, pp and cp the GPU count"
        )
    if layout.tp > gpus_per_node:
        raise ConfigError(
            f"tp={layout.tp} spans more than a node's {gpus_per_node} GPUs: tensor parallelism "
            "communicates in every block and needs NVLink; use tp <= "
            f"{gpus_per_node} and pipeline or data parallelism across nodes"
        )
    if shape.heads % layout.tp or shape.kv_heads % layout.tp:
        raise ConfigError(
            f"tp={layout.tp} does not divide the {shape.heads} attention heads and "
            f"{shape.kv_heads} key/value heads: use a tp that divides both"
        )
    stages = layout.pp * layout.stages_per_rank
    if layout.pp > 1 and stages > shape.layers:
        raise ConfigError(
            f"pp={layout.pp} with {layout.pp_schedule} is {stages} stages, more than the "
            f"{shape.layers} blocks: use a smaller pp or a schedule with one stage per rank"
        )
    if shape.seq_len % (2 * layout.cp) and layout.cp > 1:
        raise ConfigError(
            f"cp={layout.cp} does not divide the sequence of {shape.seq_len} tokens into "
            f"{2 * layout.cp} equal chunks (the causal ring balances its load over 2 x cp): "
            "use a cp whose double divides the sequence"
        )
    m = layout.microbatches
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ConfigError(f"microbatches={m!r}: give a whole number, at least 1, or None")
    if m is not None and m > 1 and layout.pp == 1:
        raise ConfigError(
            f"microbatches={m} with pp=1: micro-batches split a pipeline's step; give pp > 1, "
            "or leave microbatches out"
        )
    m = microbatches(layout, local_batch)
    if layout.pp > 1 and (local_batch % m or m < layout.pp):
        raise ConfigError(
            f"pp={layout.pp} with {m} micro-batch(es) of a local batch of {local_batch}: the "
            f"micro-batches must divide the local batch and number at least pp ({layout.pp}); "
            "give a larger batch or fewer pipeline stages"
        )
    return layout


def candidates(
    shape: TransformerShape,
    gpus: int,
    *,
    local_batch_of: int | None = None,
    float8: str | None = None,
    async_tp: bool = False,
    gpus_per_node: int = GPUS_PER_NODE,
) -> list[Layout]:
    """Every layout of ``gpus`` that :func:`check` passes for ``shape``: each factorisation
    into the five sizes, each pipeline schedule where ``pp > 1`` (with ``local_batch_of``:
    the global batch in samples, which the data-parallel ranks split; None: one sample
    each). Data-parallel ranks shard (``dp_shard``) before they replicate, as FSDP's memory
    is the point of sharding: a replica is tried only where the shards are already within
    a node."""
    found = []
    for tp in _divisors(gpus):
        for pp in _divisors(gpus // tp):
            for cp in _divisors(gpus // tp // pp):
                rest = gpus // tp // pp // cp
                for replicate in _divisors(rest):
                    shard = rest // replicate
                    if replicate > 1 and shard * cp * tp < min(gpus_per_node, gpus // replicate):
                        continue  # a replica only once a node's worth is sharded
                    data = replicate * shard
                    if local_batch_of is not None and local_batch_of % data:
                        continue
                    local = (local_batch_of // data) if local_batch_of is not None else 1
                    for schedule in SCHEDULES if pp > 1 else ("1F1B",):
                        layout = Layout(
                            replicate, shard, tp, pp, cp, schedule, None, float8, async_tp
                        )
                        layout = dataclasses.replace(layout, microbatches=local if pp > 1 else None)
                        try:
                            found.append(
                                check(
                                    layout,
                                    shape,
                                    gpus,
                                    local_batch=local,
                                    gpus_per_node=gpus_per_node,
                                )
                            )
                        except ConfigError:
                            continue
    return found


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if not n % d]


__all__ = [
    "DEGREES",
    "FLOAT8",
    "GPUS_PER_NODE",
    "SCHEDULES",
    "Layout",
    "candidates",
    "check",
    "microbatches",
]
