"""One training step's time under a layout, in closed form, and the tokens per second per GPU
it gives.

- **Compute**, for the pipeline rank with the most blocks: the matrix products' FLOPs (6 per
  weight per token, split ``tp`` ways) at :data:`LINEAR_EFFICIENCY` of the GPU's bf16 peak,
  :data:`FLOAT8_SPEEDUP` times faster under float8 where the GPU has float8 tensor cores (sm89
  and sm90: H100, H200, L40S, L4; none on sm80; the head stays bf16, as torchtitan leaves it);
  causal attention's (6 x width x sequence per token) at :data:`ATTENTION_EFFICIENCY`, slower
  by :data:`CP_STEP_OVERHEAD` per further rank of a context-parallel ring; the elementwise work
  (:data:`ELEMENTWISE_WIDTHS`) at the GPU's memory bandwidth. Checkpointing recomputes the
  forward: a third more under full, a sixth of the matrix products under selective.
- **Tensor parallelism** (sequence parallel): per block and micro-batch, two all-gathers and two
  reduce-scatters of the block's activations in forward, again in backward and in the
  recomputation, over NVLink; exposed whole (torch runs them between the matrix products), or
  :data:`ASYNC_TP_HIDDEN` of them hidden under AsyncTP.
- **Context parallelism**: torchtitan's default ring, which all-gathers the keys and values
  per block (and reduce-scatters their gradients), exposed.
- **FSDP** over ``dp_shard x cp``: all-gathers of the weights and a float32 reduce-scatter of
  the gradients, over NVLink where the group stays in a node, else the inter-node network
  (:data:`INTER_NODE_BYTES_PER_S` per GPU), hidden behind the compute of the pass they serve
  but their first block; ``dp_replicate`` all-reduces the shards' gradients across replicas.
- **Pipeline**: the bubble, ``(pp - 1) / (v x m)`` of the pipeline's compute for GPipe, 1F1B
  and interleaved 1F1B (``v`` stages per rank, ``m`` micro-batches), none for zero-bubble; and
  the point-to-point sends along the critical path.

Every constant is one for all layouts and GPUs, fitted once against torchtitan's published runs
(docs/planning.md lists them, and each run's error).

>>> from gpukit.planning.layout_shape import TransformerShape
>>> from gpukit.planning.layouts import Layout
>>> from gpukit.planning.targets import target
>>> s = TransformerShape(4096, 32, 32, 8, 14336, 128256, 8192)
>>> t = layout_time(s, Layout(dp_shard=8), target("h100"), local_batch=2, checkpointing="selective")
>>> round(t.tokens_per_s_per_gpu)
6373
"""

from __future__ import annotations

from dataclasses import dataclass

from gpukit.errors import ConfigError
from gpukit.planning.layout_memory import rank_stages
from gpukit.planning.layout_shape import TransformerShape
from gpukit.planning.layouts import GPUS_PER_NODE, Layout, microbatches
from gpukit.planning.targets import Target

# Fitted once, together, on torchtitan's 16 published H100 runs with torch.compile (500 W;
# docs/planning.md): the share of the bf16 peak the matrix products reach, and causal
# attention's (torch's flash attention kernels).
LINEAR_EFFICIENCY = 0.55
ATTENTION_EFFICIENCY = 0.22
# Bytes a block's elementwise work reads and writes per token, in widths of bf16 activation:
# fitted, as the rest (torch.compile fuses much of it).
ELEMENTWISE_WIDTHS = 200
# Memory bandwidth of GPU families (bytes/s, datasheets; a name before its prefixes).
MEMORY_BANDWIDTH = {
    "H200": 4.8e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100": 2.0e12,
    "L40S": 0.864e12,
    "L40": 0.864e12,
    "L4": 0.3e12,
}
DEFAULT_MEMORY_BANDWIDTH = 1.0e12
# Context parallelism's attention, per further rank of the ring: fitted, like the rest.
CP_STEP_OVERHEAD = 0.05
# Float8 matrix products against bf16 ones, all casting and scaling included: well under the
# datasheet's 2x. Tensorwise fitted; rowwise (finer scales, more casting) set below it, unfitted.
FLOAT8_SPEEDUP = {"tensorwise": 1.4, "rowwise": 1.25}
# GPU families with float8 tensor cores (compute capability 8.9 and 9.0).
FLOAT8_FAMILIES = ("H100", "H200", "L40S", "L40", "L4", "RTX 4090")
# Share of the datasheet's link bandwidth NCCL's collectives reach.
LINK_EFFICIENCY = 0.7
# Bytes/s per GPU between nodes: 400 Gb/s RDMA per GPU, as torchtitan's cluster.
INTER_NODE_BYTES_PER_S = 50e9
INTER_NODE_LATENCY_S = 20e-6
# Share of tensor parallelism's collectives that AsyncTP hides behind the matrix products.
ASYNC_TP_HIDDEN = 0.5
# Host time per micro-step of one pipeline stage: compiled blocks launch few kernels.
HOST_SECONDS = 2e-3
# The forward's share of a block's training FLOPs (backward is twice the forward).
FORWARD_SHARE = 1 / 3
# Recomputed share of the forward under each checkpointing: (matrix products, attention).
RECOMPUTED = {"off": (0.0, 0.0), "full": (1.0, 1.0), "selective": (0.5, 0.0)}


@dataclass(frozen=True)
class LayoutTime:
    """One step's seconds by cause (see the module doc) and the throughput they give."""

    compute_s: float
    tensor_parallel_s: float
    context_parallel_s: float
    data_parallel_s: float
    pipeline_bubble_s: float
    pipeline_send_s: float
    host_s: float
    tokens_per_s_per_gpu: float

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.tensor_parallel_s
            + self.context_parallel_s
            + self.data_parallel_s
            + self.pipeline_bubble_s
            + self.pipeline_send_s
            + self.host_s
        )

    def to_dict(self) -> dict[str, float]:
        """JSON-ready."""
        names = (
            "compute_s",
            "tensor_parallel_s",
            "context_parallel_s",
            "data_parallel_s",
            "pipeline_bubble_s",
            "pipeline_send_s",
            "host_s",
        )
        return {**{n: float(getattr(self, n)) for n in names}, "total_s": self.total_s}


def float8_speedup(target: Target, float8: str | None) -> float:
    """How much faster the matrix products run under ``float8`` on ``target`` (1 without
    float8 tensor cores: torchao's float8 then runs nowhere faster).

    >>> from gpukit.planning.targets import target
    >>> float8_speedup(target("h100"), "tensorwise"), float8_speedup(target("a100"), "rowwise")
    (1.4, 1.0)
    """
    if float8 is None or target.kind != "cuda":
        return 1.0
    upper = target.name.upper()
    return FLOAT8_SPEEDUP[float8] if any(f in upper for f in FLOAT8_FAMILIES) else 1.0


def layout_time(
    shape: TransformerShape,
    layout: Layout,
    target: Target,
    *,
    local_batch: int,
    checkpointing: str = "full",
    gpus_per_node: int = GPUS_PER_NODE,
) -> LayoutTime:
    """One step of ``local_batch`` samples per data-parallel rank under ``layout`` on GPUs of
    ``target`` (see the module doc)."""
    bf16 = target.peak_flops.get("bf16")
    if target.kind != "cuda" or not bf16:
        raise ConfigError(
            f"target {target.name}: layouts are planned for GPUs with a bf16 peak (h100, "
            "h200, a100, ...); give --target with one"
        )
    t, cp, pp, v = layout.tp, layout.cp, layout.pp, layout.stages_per_rank
    m = microbatches(layout, local_batch)
    tokens = local_batch / m * shape.seq_len / cp  # one micro-batch's, on one rank
    blocks, _, last = max(rank_stages(layout, shape), key=lambda r: r[0] + r[2])
    linear_again, attention_again = RECOMPUTED[checkpointing]
    linear_flops = 6 * shape.block_matrix_params * (1 + FORWARD_SHARE * linear_again) / t
    attention_flops = 6 * shape.dim * shape.seq_len * (1 + FORWARD_SHARE * attention_again) / t
    head_flops = last * 6 * shape.vocab * shape.dim / t
    speedup = float8_speedup(target, layout.float8)
    per_token = (
        blocks * linear_flops / (bf16 * LINEAR_EFFICIENCY * speedup)
        + blocks * attention_flops / (bf16 * ATTENTION_EFFICIENCY) * _ring_slowdown(cp)
        + head_flops / (bf16 * LINEAR_EFFICIENCY)
    )
    # Memory-bound work (norms, rotations, activations, residuals, casts): bytes per width.
    again = 1 + (linear_again > 0)
    moved = blocks * ELEMENTWISE_WIDTHS * again * 2 * shape.dim / t
    per_token += moved / _memory_bandwidth(target)
    micro_s = tokens * per_token
    compute = m * micro_s

    nvlink = target.link_bytes_per_s * LINK_EFFICIENCY
    passes = 3 if checkpointing != "off" else 2  # forward, backward, and the recomputation
    gathered = 1 if speedup > 1 and layout.float8 == "tensorwise" else 2
    activation = tokens * shape.dim  # elements of one block's (whole-sequence) activation
    per_block = passes * 2 * _ring(activation * (gathered + 2), t, nvlink, target.link_latency_s)
    tensor_parallel = m * blocks * per_block * (1 - ASYNC_TP_HIDDEN * layout.async_tp)

    kv = 2 * tokens * cp * shape.kv_dim / t * 2  # keys and values of the whole sequence
    context_parallel = m * blocks * passes * _ring(kv, cp, nvlink, target.link_latency_s)

    data_parallel = _data_parallel(shape, layout, target, blocks, last, micro_s, gpus_per_node)

    bubble = 0.0
    if pp > 1 and layout.pp_schedule != "InterleavedZeroBubble":
        bubble = (pp - 1) / (v * m) * (compute + tensor_parallel + context_parallel)
    send = 0.0
    if pp > 1:
        nbytes = 2 * activation / t
        hop = nbytes / INTER_NODE_BYTES_PER_S + INTER_NODE_LATENCY_S
        send = 2 * (pp * v - 1) * hop
    host = m * v * HOST_SECONDS
    time = LayoutTime(
        compute, tensor_parallel, context_parallel, data_parallel, bubble, send, host, 0.0
    )
    per_gpu = local_batch * shape.seq_len * layout.data_parallel / (time.total_s * layout.gpus)
    return LayoutTime(
        compute, tensor_parallel, context_parallel, data_parallel, bubble, send, host, per_gpu
    )


def _memory_bandwidth(target: Target) -> float:
    upper = target.name.upper()
    found = (bw for family, bw in MEMORY_BANDWIDTH.items() if family.upper() in upper)
    return next(found, DEFAULT_MEMORY_BANDWIDTH)


def _ring_slowdown(cp: int) -> float:
    """How much slower attention runs cut into the ring's ``2 x cp`` chunks: each step a
    separate kernel on a smaller block, its partial output merged with the others'."""
    return 1 + CP_STEP_OVERHEAD * (cp - 1)


def _data_parallel(
    shape: TransformerShape,
    layout: Layout,
    target: Target,
    blocks: int,
    last: bool,
    micro_s: float,
    gpus_per_node: int,
) -> float:
    """FSDP's exposed seconds (and HSDP's all-reduce across replicas)."""
    t, shard = layout.tp, layout.shard
    weights = (blocks * shape.block_matrix_params + last * shape.head_params) / t
    in_node = t * shard <= gpus_per_node
    bw = target.link_bytes_per_s * LINK_EFFICIENCY if in_node else INTER_NODE_BYTES_PER_S
    lat = target.link_latency_s if in_node else INTER_NODE_LATENCY_S
    gathered = 1 if layout.float8 == "tensorwise" else 2
    gather = _ring(weights * gathered, shard, bw, lat)
    reduce = _ring(weights * 4, shard, bw, lat)
    first = 1 / max(blocks, 1)  # the first block's share: nothing to hide behind
    forward_s, backward_s = micro_s * FORWARD_SHARE, micro_s * (1 - FORWARD_SHARE)
    if layout.pp == 1:  # gathered again for backward
        exposed = _exposed(gather, forward_s, first) + _exposed(gather + reduce, backward_s, first)
    else:  # gathered once for the step, reduced after the last micro-batch
        exposed = _exposed(gather, forward_s, first) + _exposed(reduce, backward_s, first)
    if layout.dp_replicate > 1:
        shards = weights * 4 / shard
        across = 2 * _ring(shards, layout.dp_replicate, INTER_NODE_BYTES_PER_S, 0.0)
        exposed += _exposed(across, backward_s, first)
    return exposed


def _exposed(comm_s: float, compute_s: float, first: float) -> float:
    return max(comm_s - compute_s, comm_s * first)


def _ring(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather or reduce-scatter whose whole result is ``nbytes``."""
    return 0.0 if n < 2 else (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


__all__ = ["LayoutTime", "float8_speedup", "layout_time"]
