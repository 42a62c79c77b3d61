"""The planner's instant estimate: each device's peak tensor memory from a model's facts.

No simulation: the peak is the larger of two moments of a step, summed category by category.

- the backward's peak: parameters, buffers, optimizer state, what the forward saved and the
  gradients of activations being computed (gradients too when micro-batches accumulate);
- the optimizer step: parameters, gradients, optimizer state and the step's temporaries
  (AdamW's foreach step holds one trainable-sized tensor, the denominator), with the batch.

Per strategy, from its :class:`~gpukit.strategies.Traits`: reducer buckets (ddp) add the
trainable bytes; sharded states (fsdp) are divided by N (``ceil(rows / N)`` rows per tensor,
as FSDP2 shards dim 0), and gathering weights adds the root's gathered weights, two gathered
blocks (one prefetched), one block's unsharded gradients and its reduce-scatter buffer; one
process driving every device (dp) keeps the model, gradients and optimizer state on the first
device, parameter replicas (and their gradients in the backward) on the others, and the whole
batch on the first, with its gathered outputs and the loss where the outputs are gathered
(dp-balanced computes the loss on each device). Mixed precision keeps float32 weights and
gradients (gpukit autocasts the forward only), so only activations change dtype. FSDP2's
mixed precision (``mixed="bf16"``: bf16 parameters gathered and computed with, gradients
reduced in float32) halves the gathered blocks and a block's unsharded gradients, while the
reduce-scatter input stays float32; the activations come from facts measured with bf16
parameters (:func:`model_facts`'s ``param_dtype``).
``granularity`` rounds each tensor up (512 on CUDA); activations by half a granule on average.

>>> facts = ModelFacts(400, 0, 0, 100, 400, 1000, 0, 40, 128, 0.0)
>>> [p.peak_bytes for p in closed_form(facts, strategy="ddp", devices=2, micro_batch=8)]
[9604, 9604]
"""

from __future__ import annotations

from gpukit.errors import ConfigError
from gpukit.planning import registered
from gpukit.planning.facts import PRECISIONS, ModelFacts, model_facts
from gpukit.planning.result import BREAKDOWN, DevicePeak
from gpukit.strategies.traits import State, Traits

__all__ = ["MIXED", "OPTIMIZERS", "ModelFacts", "closed_form", "model_facts"]

# FSDP2 mixed precision policies the closed form models (parameter dtype; float32 reduction).
MIXED = ("bf16",)

# Optimizer state per trainable float32 element and the step's temporaries, in copies of it.
OPTIMIZERS = {"adamw": (2, 1), "adam": (2, 1), "sgd": (0, 0), "sgd-momentum": (1, 0)}


def closed_form(
    facts: ModelFacts,
    *,
    strategy: str,
    devices: int,
    micro_batch: int,
    accumulate: int = 1,
    optimizer: str = "adamw",
    precision: str = "32",
    granularity: int = 1,
    mixed: str | None = None,
) -> tuple[DevicePeak, ...]:
    """Each device's predicted peak for ``strategy`` on ``devices`` devices at ``micro_batch``
    samples per device (see the module doc); ``cuda_context`` and ``allocator_reserve`` are
    left at 0 for the calibration to fill. ``mixed``: "bf16" for FSDP2's mixed precision
    (strategies that gather weights only)."""
    traits = _check(strategy, devices, micro_batch, accumulate, optimizer, precision, granularity)
    if mixed not in (None, *MIXED):
        raise ConfigError(f"mixed={mixed!r}: use None or one of {', '.join(MIXED)}")
    if mixed is not None and not traits.gathers_weights:
        raise ConfigError(
            f"mixed={mixed!r} is FSDP2's mixed precision: {strategy} gathers no weights; "
            "plan it with precision='bf16-mixed' instead"
        )
    g = granularity
    states, temps = OPTIMIZERS[optimizer]
    buckets, one_process = traits.gradient_buckets, traits.drives_all_devices
    rows = facts.parameter_rows or ((1, facts.trainable_bytes, True),)

    def shard(state: State) -> tuple[int, int]:
        """Trainable and frozen bytes per device of ``state`` (weights or gradients)."""
        n = traits.divisor(state, devices)
        trained = sum(_round(-(-r // n) * b, g) for r, b, t in rows if t)
        frozen = sum(_round(-(-r // n) * b, g) for r, b, t in rows if not t)
        if not facts.parameter_rows:
            frozen = _round(-(-facts.frozen_bytes // n), g)
        return trained, frozen

    weights, frozen = shard("weights")
    trainable, _ = shard("gradients")
    tensors_trained = sum(1 for *_, t in rows if t)
    # float32 state per trainable element; Adam's step counters: one scalar per tensor.
    fp32 = _round(-(-facts.trainable_numel // traits.divisor("optimizer_state", devices)) * 4, g)
    optimizer_state = states * fp32 + (tensors_trained * _round(4, g) if states == 2 else 0)
    model = {
        "parameters": weights + frozen,
        "buffers": _round(facts.buffer_bytes, g),
        "optimizer_state": optimizer_state,
    }
    rounding = facts.activation_tensors * (g - 1) // 2
    batch = (facts.input_bytes_per_sample + facts.target_bytes_per_sample) * micro_batch
    activations = facts.activations(micro_batch) + rounding
    backward = facts.backward_extra(micro_batch)
    communication = reducing = 0
    if buckets:
        communication = _round(facts.trainable_bytes, g)
    elif traits.gathers_weights:
        largest, root = facts.largest_group_bytes, facts.root_group_bytes
        block = facts.largest_block_bytes or largest
        gathered = root + (min(2, facts.block_groups) * block if facts.block_groups else 0)
        # A block's unsharded gradients and its reduce-scatter input: with blocks, while
        # activations are still held; without, only once the backward freed them; the
        # largest group's (the root's, it may be) once the backward freed them. Mixed:
        # gathered weights and unsharded gradients in 2 bytes, the reduction in float32.
        half = 2 if mixed is not None else 1
        gathered //= half
        reducing = gathered + largest // half + largest
        in_backward = gathered + block // half + block
        communication = in_backward if facts.block_groups else gathered
    step_comm = _round(facts.trainable_bytes, g) if buckets else 0
    peaks = []
    for index in range(devices):
        extra_act, extra_tmp, replica = _data_parallel(facts, traits, index, devices, micro_batch)
        if replica:
            own = {"parameters": weights + frozen, "buffers": model["buffers"]}
            backward_peak = {
                **own,
                "activations": activations + extra_act,
                "temporaries": backward + trainable,
            }
            peaks.append(DevicePeak(f"device {index}", _full(backward_peak)))
            continue
        held_grads = trainable if accumulate > 1 else 0
        backward_peak = {
            **model,
            "gradients": held_grads,
            "communication": communication,
            "activations": activations + extra_act,
            "temporaries": backward + extra_tmp,
        }
        step_peak = {
            **model,
            "gradients": trainable,
            "communication": step_comm,
            "activations": batch * (devices if one_process else 1),
            "temporaries": temps * fp32,
        }
        reduce_peak = {**model, "communication": reducing, "activations": batch}
        phases = (backward_peak, step_peak, reduce_peak)
        worst = max(phases, key=lambda d: sum(d.values()))
        peaks.append(DevicePeak(f"device {index}", _full(worst)))
    return tuple(peaks)


def _data_parallel(
    facts: ModelFacts, traits: Traits, index: int, devices: int, micro_batch: int
) -> tuple[int, int, bool]:
    """Extra activations and temporaries a DataParallel device holds, and whether it is a
    replica (not the first device)."""
    gathers = traits.gathers_outputs
    if not traits.drives_all_devices or devices == 1:
        return 0, 0, False
    others = devices - 1
    loss = facts.loss_bytes_per_sample * micro_batch
    if index > 0:
        # The loss runs on the first device under dp: a replica holds none of it.
        return (-loss if gathers else 0), 0, True
    whole_batch = (facts.input_bytes_per_sample + facts.target_bytes_per_sample) * others
    if not gathers:
        return whole_batch * micro_batch, 0, False
    gathered = facts.output_bytes_per_sample * micro_batch * devices
    return whole_batch * micro_batch + gathered + loss * others, gathered, False


def _full(parts: dict[str, int]) -> dict[str, int]:
    return {k: max(0, int(parts.get(k, 0))) for k in BREAKDOWN}


def _round(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _check(
    strategy: str,
    devices: int,
    micro_batch: int,
    accumulate: int,
    optimizer: str,
    precision: str,
    granularity: int,
) -> Traits:
    """The strategy's traits, once every argument is known good."""
    if not isinstance(strategy, str) or strategy not in registered.names():
        raise ConfigError(
            f"unknown strategy {strategy!r} for the closed form: use one of "
            f"{', '.join(registered.names())}"
        )
    traits = registered.traits(strategy)
    if optimizer not in OPTIMIZERS:
        raise ConfigError(
            f"unknown optimizer {optimizer!r}: the closed form knows {', '.join(OPTIMIZERS)}; "
            "pick the one whose state matches yours"
        )
    if precision not in PRECISIONS:
        raise ConfigError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    for name, value in (
        ("devices", devices),
        ("micro_batch", micro_batch),
        ("accumulate", accumulate),
        ("granularity", granularity),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r}: give an int >= 1")
    most = traits.max_devices
    if most is not None and devices > most:
        raise ConfigError(
            f"strategy {strategy!r} runs on {most} device(s), got devices={devices}: use {most}"
        )
    return traits
