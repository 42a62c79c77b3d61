"""How long one optimizer step takes, by cause: compute, the communication compute does not
hide, and host overhead; and from it samples/s and MFU.

A closed form, so that it answers instantly for every strategy and device count:

- **Compute** per device: ``flops_per_sample x micro_batch x accumulate`` over the peak of the
  precision's dtype times an efficiency (:data:`EFFICIENCY`: what real training reaches of the
  datasheet peak), or the seconds per sample a calibration measured.
- **Communication**: the alpha-beta model of ring collectives over ``N`` devices, ``latency``
  per hop and ``bandwidth`` per link. All-reduce moves ``2(N-1)/N`` of the bytes in ``2(N-1)``
  hops; all-gather and reduce-scatter ``(N-1)/N`` in ``N-1``. Which collectives a strategy
  runs, how often and behind which pass, its traits say
  (:class:`~gpukit.strategies.Collective`). The collectives hidden behind one pass together
  are exposed where they exceed its compute, and at least their one piece that cannot hide
  (DDP's last bucket, FSDP's first block); those hidden behind none are exposed whole.

  - ddp: one all-reduce of the gradients per optimizer step (accumulation skips the sync),
    overlapped with the last micro-step's backward except the last bucket's.
  - fsdp: per micro-step, an all-gather of the parameters in forward and again in backward and
    a reduce-scatter of the gradients, each block's behind the compute of the block before.
  - dp, dp-balanced (one process driving N GPUs): per micro-step, a broadcast of the
    parameters to the N-1 replicas, a reduce of their gradients to the first GPU, and the
    inputs scattered from and outputs gathered to it; nothing overlaps.
- **FSDP2 mixed precision** (``mixed="bf16"``): the parameters are gathered and computed
  with in bf16, so the matrix products run at bf16's peak whatever ``precision`` says, the
  all-gathers move two bytes per parameter and the reduce-scatters four (float32 reduction).
- **Host**: a fixed cost per micro-step (Python, kernel launches; :data:`HOST_SECONDS`, or the
  calibration's fixed seconds); one process driving every device launches every replica's
  kernels.

>>> from gpukit.planning.targets import target
>>> for strategy in ("ddp", "fsdp", "dp"):
...     t, per_s, mfu = step_time(target=target("h100"), strategy=strategy, devices=8,
...         micro_batch=8, accumulate=1, flops_per_sample=6e12, trainable_bytes=4 * 10**9,
...         largest_group_bytes=10**8, precision="bf16-mixed")
...     print(strategy, round(t.compute_s, 3), round(t.communication_s, 4), round(mfu, 2))
ddp 0.108 0.0002 0.44
fsdp 0.108 0.0005 0.44
dp 0.108 0.0178 0.34
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from gpukit.errors import ConfigError
from gpukit.planning import registered
from gpukit.planning.result import StepTime
from gpukit.planning.targets import Target
from gpukit.strategies.traits import Collective, Op, Traits

if TYPE_CHECKING:
    from gpukit.planning.calibrate import Calibration

# Share of the datasheet peak that training reaches when nothing else limits it: large
# transformer runs report 40-55% MFU on A100 and H100 (bf16); 0.45 is their middle. A CPU
# reaches less of its (estimated) vector peak in torch's kernels.
EFFICIENCY = {"cuda": 0.45, "cpu": 0.3}
# Python and launch overhead per micro-step that the device waits on: a training step of a
# small model in eager PyTorch costs ~1-3 ms of host time; calibration measures it.
HOST_SECONDS = 2e-3
# Backward is ~2/3 of a training step's FLOPs (twice the forward): the window DDP's all-reduce
# and FSDP's backward collectives hide behind; forward's third hides FSDP's forward gathers.
BACKWARD_SHARE = 2 / 3
# DDP's gradient bucket (bucket_cap_mb=25): the last one fills when backward ends, so its
# all-reduce cannot overlap.
DDP_BUCKET_BYTES = 25 * 2**20

# The dtype whose peak a precision runs its matmuls at. "32" is plain float32: torch leaves
# TF32 off for matmuls unless asked, so its peak is fp32's.
# FSDP2 mixed precision: the bytes of a parameter gathered in each modelled dtype.
MIXED_BYTES = {"bf16": 2}

PRECISION_DTYPES = {
    "32": "fp32",
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16-mixed": "bf16",
    "bf16": "bf16",
    "16-mixed": "fp16",
    "fp16": "fp16",
}


def ring_all_reduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` devices.

    >>> ring_all_reduce_s(1e9, 2, 1e9, 0.0)
    1.0
    """
    return 0.0 if n < 2 else 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def ring_gather_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) whose full result has ``nbytes``.

    >>> ring_gather_s(1e9, 4, 1e9, 0.0)
    0.75
    """
    return 0.0 if n < 2 else (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


def step_time(
    *,
    target: Target,
    strategy: str,
    devices: int,
    micro_batch: int,
    accumulate: int,
    flops_per_sample: float,
    trainable_bytes: int,
    largest_group_bytes: int,
    precision: str,
    calibration: Calibration | None = None,
    io_bytes_per_sample: int = 0,
    mixed: str | None = None,
    trainable_numel: int = 0,
) -> tuple[StepTime, float, float | None]:
    """(step time by cause, samples/s, MFU) of one optimizer step (see the module doc).

    ``micro_batch`` is per device; ``trainable_bytes`` the gradients' bytes (as many as the
    parameters that train); ``largest_group_bytes`` the largest unit FSDP gathers at once (a
    block); ``io_bytes_per_sample`` an input and its output, which DataParallel moves through
    the first GPU. MFU is None where the peak is not a datasheet figure (a CPU). ``mixed``:
    "bf16" for FSDP2's mixed precision (see the module doc), whose collectives' bytes follow
    from ``trainable_numel`` (default: ``trainable_bytes`` of float32 parameters).

    >>> from gpukit.planning.targets import target
    >>> t, per_s, mfu = step_time(target=target("a100"), strategy="single", devices=1,
    ...     micro_batch=4, accumulate=2, flops_per_sample=1e12, trainable_bytes=10**9,
    ...     largest_group_bytes=10**8, precision="32")
    >>> t.communication_s, round(per_s, 1)
    (0.0, 8.7)
    """
    traits = _check(strategy, devices, micro_batch, accumulate, flops_per_sample, calibration)
    for name, value in (
        ("trainable_bytes", trainable_bytes),
        ("largest_group_bytes", largest_group_bytes),
        ("io_bytes_per_sample", io_bytes_per_sample),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}={value!r}: give a whole number of bytes, 0 or more")
    if mixed is not None and mixed not in MIXED_BYTES:
        raise ConfigError(f"mixed={mixed!r}: use None or one of {', '.join(MIXED_BYTES)}")
    if mixed is not None and PRECISION_DTYPES.get(precision) in ("fp32", "tf32"):
        precision = mixed  # the matrix products take the gathered parameters' dtype
    peak = _peak(target, precision, required=calibration is None)
    samples = micro_batch * accumulate
    if calibration is not None:
        micro_s = calibration.seconds_per_sample * micro_batch
        host_micro_s = calibration.fixed_seconds
    else:
        assert peak is not None  # _peak raised otherwise
        micro_s = flops_per_sample * micro_batch / (peak * EFFICIENCY[target.kind])
        host_micro_s = HOST_SECONDS
    compute = micro_s * accumulate
    numel = trainable_numel or trainable_bytes // 4
    moved = {
        "gradients": numel * 4 if mixed else trainable_bytes,  # reduced in float32
        "weights": numel * MIXED_BYTES[mixed] if mixed else trainable_bytes,
        "samples": io_bytes_per_sample * micro_batch,
    }
    group, grads = largest_group_bytes, trainable_bytes
    blocks = max(1, math.ceil(grads / group)) if group else 1
    largest = min(1.0, group / grads) if group and grads else 1.0  # the largest block's share
    exposed = _exposed(
        traits.collectives, _Link(target, devices), micro_s, accumulate, moved, blocks, largest
    )
    host_factor = float(devices) if traits.drives_all_devices and devices > 1 else 1.0
    time = StepTime(compute, exposed, host_micro_s * accumulate * host_factor)
    measured = calibration.line(strategy, devices) if calibration is not None else None
    if measured is not None and devices > 1:
        time = measured_time(
            measured.at(micro_batch) * accumulate, compute, host_micro_s * accumulate
        )
    global_batch = samples * devices
    samples_per_s = global_batch / time.total_s
    mfu = None
    if target.kind == "cuda" and peak and flops_per_sample > 0:
        mfu = flops_per_sample * global_batch / (time.total_s * devices * peak)
    return time, samples_per_s, mfu


def measured_time(total_s: float, compute_s: float, host_s: float) -> StepTime:
    """A step measured whole (``total_s``: a strategy on several devices, calibrated here)
    split by cause: one device's compute and host time (``compute_s``, ``host_s``), and the
    rest as communication (collectives, copies, processes sharing the host); one device's
    parts scaled down where the whole took less.

    >>> measured_time(0.5, 0.3, 0.1).communication_s, measured_time(0.2, 0.3, 0.1).compute_s
    (0.1, 0.15)
    """
    single = compute_s + host_s
    if total_s >= single:
        return StepTime(compute_s, round(total_s - single, 15), host_s)
    scale = total_s / single if single else 0.0
    return StepTime(round(compute_s * scale, 15), 0.0, round(host_s * scale, 15))


class _Link:
    """The collectives' costs over ``n`` devices of ``target``."""

    def __init__(self, target: Target, n: int) -> None:
        self.n, self.bw, self.lat = n, target.link_bytes_per_s, target.link_latency_s

    def all_reduce(self, nbytes: float) -> float:
        return ring_all_reduce_s(nbytes, self.n, self.bw, self.lat)

    def gather(self, nbytes: float) -> float:
        return ring_gather_s(nbytes, self.n, self.bw, self.lat)

    def one_to_all(self, nbytes: float) -> float:
        """A broadcast (or reduce) of ``nbytes`` from one device to the N-1 others, pipelined
        in chunks down a chain: the bytes cross each link once, plus a hop's latency each."""
        return 0.0 if self.n < 2 else nbytes / self.bw + (self.n - 1) * self.lat


def _exposed(
    collectives: tuple[Collective, ...],
    link: _Link,
    micro_s: float,
    acc: int,
    moved: dict[str, int],
    blocks: int,
    largest: float,
) -> float:
    """Exposed communication seconds per optimizer step: the collectives hidden behind one
    pass (or none) together, per micro-step times ``acc`` plus per step. ``moved``: the bytes
    of each payload; ``blocks``: the pieces a per-block collective is cut in, the ``largest``
    holding that share of its bytes."""
    passes: dict[tuple[str, str | None], list[Collective]] = {}
    for c in collectives:
        passes.setdefault((c.per, c.hidden_by), []).append(c)
    per_micro = per_step = 0.0
    for (per, hidden_by), together in passes.items():
        total = sum(_seconds(c, link, moved[c.payload], blocks) for c in together)
        if hidden_by is not None:
            share = BACKWARD_SHARE if hidden_by == "backward" else 1 - BACKWARD_SHARE
            first = together[0]
            total = max(
                total - share * micro_s, _unhidden(first, link, moved[first.payload], largest)
            )
        if per == "micro-step":
            per_micro += total
        else:
            per_step += total
    return acc * per_micro + per_step


def _seconds(c: Collective, link: _Link, nbytes: int, blocks: int) -> float:
    """Seconds of one collective ``c`` of ``nbytes`` in one pass, over all its pieces."""
    if c.unit == "block" and link.n >= 2:
        # Each block is its own collective: its latency counts once per block.
        return blocks * _cost(c.op, link, nbytes / blocks)
    return _cost(c.op, link, nbytes)


def _unhidden(c: Collective, link: _Link, nbytes: int, largest: float) -> float:
    """What of collective ``c`` no compute hides: DDP's last bucket, FSDP's first block (the
    ``largest`` share of the bytes)."""
    if c.unit == "bucket":
        return _cost(c.op, link, min(nbytes, DDP_BUCKET_BYTES))
    if c.unit == "block":
        return _cost(c.op, link, nbytes * largest)
    return 0.0


def _cost(op: Op, link: _Link, nbytes: float) -> float:
    if op == "all-reduce":
        return link.all_reduce(nbytes)
    if op in ("all-gather", "reduce-scatter"):
        return link.gather(nbytes)
    if op in ("broadcast", "reduce"):
        return link.one_to_all(nbytes)
    # scatter-gather: the first device sends every other its share of the inputs and
    # receives its outputs, one copy after another through its own link.
    return 0.0 if link.n < 2 else (link.n - 1) / link.n * nbytes * link.n / link.bw


def _peak(target: Target, precision: str, *, required: bool) -> float | None:
    dtype = PRECISION_DTYPES.get(precision) if isinstance(precision, str) else None
    if dtype is None:
        raise ConfigError(
            f"precision {precision!r}: use one of {', '.join(PRECISION_DTYPES)} "
            "('auto' is resolved by the Runtime: plan with the precision it picks)"
        )
    if target.kind == "cpu":  # one estimate for every dtype: a CPU has no faster 16-bit path
        dtype = "fp32" if dtype not in target.peak_flops else dtype
    peak = target.peak_flops.get(dtype)
    if not peak and required:
        known = ", ".join(target.peak_flops) or "none"
        raise ConfigError(
            f"{target.name} has no known {dtype} peak (known: {known}): plan with a precision "
            "it has, or pass a calibration measured on it"
        )
    return peak


def _check(
    strategy: str,
    devices: int,
    micro_batch: int,
    accumulate: int,
    flops_per_sample: float,
    calibration: Calibration | None,
) -> Traits:
    """The strategy's traits, once every argument is known good."""
    if not isinstance(strategy, str) or strategy not in registered.names():
        raise ConfigError(f"strategy {strategy!r}: use one of {', '.join(registered.names())}")
    traits = registered.traits(strategy)
    for name, value in (
        ("devices", devices),
        ("micro_batch", micro_batch),
        ("accumulate", accumulate),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: give a whole number of at least 1")
    if traits.max_devices == 1 and devices != 1:
        several = [s for s in registered.names() if registered.traits(s).process_per_device]
        raise ConfigError(
            f"strategy {strategy!r} runs on one device, not devices={devices}: "
            f"plan it with devices=1, or use {' or '.join(several)} for several"
        )
    bad = not isinstance(flops_per_sample, (int, float)) or not math.isfinite(flops_per_sample)
    if bad or flops_per_sample < 0 or (flops_per_sample == 0 and calibration is None):
        raise ConfigError(
            f"flops_per_sample={flops_per_sample!r}: give the training FLOPs of one sample "
            "(about 3x its forward's; gpukit.workloads.flops.forward_flops counts those), "
            "or 0 with a calibration"
        )
    return traits


__all__ = [
    "BACKWARD_SHARE",
    "DDP_BUCKET_BYTES",
    "EFFICIENCY",
    "HOST_SECONDS",
    "MIXED_BYTES",
    "PRECISION_DTYPES",
    "measured_time",
    "ring_all_reduce_s",
    "ring_gather_s",
    "step_time",
]
