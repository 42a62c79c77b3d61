"""Each GPU's peak memory under a layout, in closed form from the decoder's sizes.

What a GPU holds, for the pipeline rank that holds the most (torchtitan reports the largest
across GPUs), in the categories of :data:`gpukit.planning.result.BREAKDOWN`:

- **parameters, gradients, optimizer_state**: FSDP2 with bf16 parameters and float32
  reduction, AdamW: 4 + 4 + 8 bytes per weight, of the blocks of this rank's pipeline stages
  (torchtitan's split: the first and last stages a block fewer where they do not divide), the
  embedding on the first, the head on the last, split ``tp`` ways and sharded ``dp_shard x cp``
  ways.
- **communication**: the weights FSDP gathers in bf16 (float8 for the matrices under
  ``float8="tensorwise"``, which gathers them so): two blocks at once and the embedding and
  head without pipelining; with it, the whole stage for the whole step (torchtitan keeps a
  stage's weights gathered across its micro-batches) and its gradients unsharded in float32
  (FSDP2 accumulates them in the reduction's dtype until the last micro-batch's reduction).
- **activations**: what each block saves for backward, per token of a micro-batch, split by
  ``tp`` (sequence parallelism splits the rest) and ``cp`` (tokens): with full checkpointing a
  block's input; with selective (torchtitan's op policy: every second matrix product and
  attention kept) those outputs; without, every block's tensors (:data:`SAVED_WIDTHS`); times
  the micro-batches the schedule holds at once on the first rank (GPipe: all; 1F1B: ``pp``;
  interleaved: torch's warm-up count of stage-micro-batches).
- **temporaries**: the larger of the loss over the vocabulary (float32 log-probabilities and,
  in its backward, two more float32 logits-sized tensors, for one micro-batch; split by ``tp``
  under loss parallelism, whose unfused backward holds two more) on the last rank, and one
  block's whole activations and gradients while it is recomputed under checkpointing.
- **allocator_reserve**: 5% of the tensors and FSDP's gathered weights once more (allocated on
  streams of their own), as ``gk.plan`` adds for fsdp; and the CUDA context.

>>> from gpukit.planning.layout_shape import TransformerShape
>>> from gpukit.planning.layouts import Layout
>>> s = TransformerShape(4096, 32, 32, 8, 14336, 128256, 32768)
>>> parts = layout_memory(s, Layout(dp_shard=8), local_batch=1, checkpointing="full")
>>> round(sum(v for k, v in parts.items() if k != "cuda_context") / 2**30, 1)
90.7
"""

from __future__ import annotations

from gpukit.planning.layout_shape import TransformerShape
from gpukit.planning.layouts import Layout, microbatches
from gpukit.planning.targets import ALLOCATOR_RESERVE_FRACTION, CUDA_CONTEXT_BYTES

CHECKPOINTING = ("off", "full", "selective")
# Bytes per weight of FSDP2 with bf16 parameters and float32 reduction under AdamW: the float32
# shard, its float32 gradient, and Adam's two float32 moments.
SHARD_BYTES = {"parameters": 4, "gradients": 4, "optimizer_state": 8}
# bf16 activations a block saves for backward, in widths of dim, kv_dim and hidden per token:
# full: its input; selective: every second matrix product's output (q, v, w1, w2) and
# attention's, and the input; off: inputs of both norms in float32, the normed inputs, q, k, v
# before and after rotation, attention's output, o, w1, w3, silu and their product.
# Under tensor parallelism the norms' outputs are gathered whole for the matrix products
# (sequence parallelism splits them again after): (split by tp, whole, kv_dim, hidden) widths.
SAVED_WIDTHS = {
    "full": (1, 0, 0, 0),
    "selective": (4, 0, 1, 1),
    "off": (10, 2, 4, 4),
}
# One block's backward under checkpointing: its recomputed tensors (``off``) and the gradients
# in flight (the gathered inputs' and the feed-forward's).
BACKWARD_WIDTHS = (12, 4, 4, 6)
# The loss over the vocabulary: float32 log-probabilities saved, and in backward two more
# float32 logits-sized tensors at once (the gradient coming in and going out).
# The bf16 logits stay alive while the loss's forward upcasts them (2 more bytes at its peak).
LOSS_BYTES_PER_LOGIT = 14
# Under tensor parallelism the loss is torch's loss_parallel, unfused: its backward holds the
# saved log-probabilities, a zeroed gradient, their exponentials' sum and its product at once.
LOSS_PARALLEL_BYTES_PER_LOGIT = 16


def stage_layers(layers: int, stages: int) -> list[int]:
    """Blocks per pipeline stage as torchtitan splits them by default: ``layers // stages``
    each, the middle stages one more until the rest is used.

    >>> stage_layers(126, 8)
    [15, 16, 16, 16, 16, 16, 16, 15]
    """
    base, extra = divmod(layers, stages)
    sizes = [base] * stages
    for i in range(1, stages - 1):
        if extra:
            sizes[i] += 1
            extra -= 1
    sizes[-1] += extra  # what the middle could not take
    return sizes


def rank_stages(layout: Layout, shape: TransformerShape) -> list[tuple[int, bool, bool]]:
    """(blocks, holds the embedding, holds the head) of each pipeline rank: rank ``r`` holds
    stages ``r, r + pp, ...`` (torchtitan's loop order)."""
    stages = layout.pp * layout.stages_per_rank
    sizes = stage_layers(shape.layers, stages)
    ranks = []
    for r in range(layout.pp):
        own = range(r, stages, layout.pp)
        ranks.append((sum(sizes[i] for i in own), 0 in own, stages - 1 in own))
    return ranks


def layout_memory(
    shape: TransformerShape,
    layout: Layout,
    *,
    local_batch: int,
    checkpointing: str = "full",
) -> dict[str, int]:
    """The largest GPU's peak under ``layout`` (see the module doc), by category, with
    ``local_batch`` samples per data-parallel rank and ``checkpointing`` ("off", "full",
    "selective")."""
    peaks = [
        _rank_memory(shape, layout, local_batch, checkpointing, rank, stage)
        for rank, stage in enumerate(rank_stages(layout, shape))
    ]
    return max(peaks, key=lambda parts: sum(parts.values()))


def _rank_memory(
    shape: TransformerShape,
    layout: Layout,
    local_batch: int,
    checkpointing: str,
    rank: int,
    stage: tuple[int, bool, bool],
) -> dict[str, int]:
    blocks, first, last = stage
    t, shard = layout.tp, layout.shard
    matrices = blocks * shape.block_matrix_params
    others = first * shape.embedding_params + last * shape.head_params + blocks * 2 * shape.dim
    weights = (matrices + others) / t  # norms are replicated but small
    parts = {k: int(v * weights / shard) for k, v in SHARD_BYTES.items()}
    matrix_bytes = 1 if layout.float8 == "tensorwise" else 2
    block_gathered = shape.block_matrix_params / t * matrix_bytes
    ends_gathered = 2 * (first * shape.embedding_params + last * shape.head_params) / t
    m = microbatches(layout, local_batch)
    if layout.pp == 1:
        gathered = 2 * block_gathered + ends_gathered
        # one block's gradients unsharded: bf16 from autograd, float32 for the reduce-scatter
        # and the embedding's and head's (bf16) until the root's reduction at the end
        unsharded_grads = 6 * shape.block_matrix_params / t + ends_gathered
    else:
        gathered = matrices / t * matrix_bytes + ends_gathered
        unsharded_grads = 4 * weights if m > 1 else 2 * weights
    parts["communication"] = int(gathered)
    parts["gradients"] += int(unsharded_grads)

    tokens = local_batch // m * shape.seq_len / layout.cp  # one micro-batch's, on this rank
    per_chunk = blocks / layout.stages_per_rank
    held = _held_chunks(layout, m, rank) * per_chunk
    parts["activations"] = int(held * _block_bytes(shape, t, tokens, SAVED_WIDTHS[checkpointing]))
    recompute = _block_bytes(shape, t, tokens, BACKWARD_WIDTHS)
    per_logit = LOSS_PARALLEL_BYTES_PER_LOGIT if t > 1 else LOSS_BYTES_PER_LOGIT
    loss = last * tokens * shape.vocab / t * per_logit
    parts["temporaries"] = int(max(loss, recompute if checkpointing != "off" else 0.0))

    tensors = sum(parts.values())
    streams = parts["communication"] if layout.shard > 1 else 0
    parts["allocator_reserve"] = int(tensors * ALLOCATOR_RESERVE_FRACTION + streams)
    parts["cuda_context"] = CUDA_CONTEXT_BYTES
    return parts


def _block_bytes(
    shape: TransformerShape, t: int, tokens: float, widths: tuple[int, int, int, int]
) -> float:
    """bf16 bytes of ``widths`` (see :data:`SAVED_WIDTHS`) for ``tokens`` tokens of a block."""
    split, whole, kv, hidden = widths
    per_token = (split * shape.dim + kv * shape.kv_dim + hidden * shape.hidden) / t
    return 2 * tokens * (per_token + whole * shape.dim)


def _held_chunks(layout: Layout, m: int, rank: int) -> int:
    """Stage-micro-batches whose activations pipeline rank ``rank`` holds at once at most:
    the schedule's warm-up forwards and the one in steady state."""
    pp, v = layout.pp, layout.stages_per_rank
    if pp == 1:
        return 1
    if layout.pp_schedule == "GPipe":
        return m * v
    if v == 1:  # 1F1B: pp - rank forwards before the first backward
        return min(m, pp - rank)
    # Interleaved (torch's Interleaved1F1B, and zero-bubble schedules, which keep its
    # memory): (v - 1) rounds of micro-batches plus 2 per rank behind, then one more.
    rounds = max(1, m // pp)
    warmup = (v - 1) * (m // rounds) + 2 * (pp - 1 - rank)
    return min(m * v, warmup + 1)


__all__ = ["CHECKPOINTING", "layout_memory", "rank_stages", "stage_layers"]
