"""What the planner predicts for one (strategy, device count, micro-batch): each device's peak
memory with its breakdown, the step time split by cause, and whether it fits.

>>> peak = DevicePeak("rank 0", {"parameters": 100, "activations": 50})
>>> peak.peak_bytes
150
>>> Plan("ddp", 2, 8, 1, "32", "off", (peak, peak), capacity_bytes=200).fits
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gpukit.diagnostics.live_tensors import CATEGORIES

# What a device's peak is made of: the tensors the counter files (see
# gpukit.diagnostics.live_tensors), and on a GPU what no tensor accounts for: the CUDA context
# (the driver's, per process) and the caching allocator's reserve above what tensors hold
# (rounding, fragmentation).
BREAKDOWN = (*CATEGORIES, "cuda_context", "allocator_reserve")

Method = Literal["simulation", "closed-form"]


@dataclass(frozen=True)
class DevicePeak:
    """One device's predicted peak: ``breakdown`` maps :data:`BREAKDOWN` names to bytes at
    the moment the total peaks (names left out are 0)."""

    device: str
    breakdown: dict[str, int]

    @property
    def peak_bytes(self) -> int:
        """The peak: the breakdown's sum."""
        return sum(self.breakdown.values())

    @property
    def tensor_bytes(self) -> int:
        """The peak of tensors alone (what ``torch.cuda.max_memory_allocated`` measures)."""
        return sum(v for k, v in self.breakdown.items() if k in CATEGORIES)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "peak_tensors": self.tensor_bytes,
            "breakdown": {k: int(self.breakdown.get(k, 0)) for k in BREAKDOWN},
        }


@dataclass(frozen=True)
class StepTime:
    """One optimizer step's predicted seconds, by cause: ``compute`` (forward, backward and
    optimizer kernels), ``communication`` (the part of the collectives not hidden behind
    compute) and ``host`` (Python and launch overhead the device waits on)."""

    compute_s: float
    communication_s: float
    host_s: float

    @property
    def total_s(self) -> float:
        """The step's seconds."""
        return self.compute_s + self.communication_s + self.host_s

    def to_dict(self) -> dict[str, float]:
        """JSON-ready."""
        return {
            "step_time_s": self.total_s,
            "compute_s": self.compute_s,
            "communication_s": self.communication_s,
            "host_s": self.host_s,
        }


@dataclass(frozen=True)
class Plan:
    """A prediction for ``strategy`` on ``devices`` devices at ``micro_batch`` samples per
    device per micro-step, ``accumulate`` micro-steps per optimizer step."""

    strategy: str
    devices: int
    micro_batch: int
    accumulate: int
    precision: str
    activation_checkpointing: str
    per_device: tuple[DevicePeak, ...]
    step_time: StepTime | None = None
    samples_per_s: float | None = None
    mfu: float | None = None
    capacity_bytes: int | None = None
    largest_micro_batch: int | None = None
    method: Method = "simulation"
    notes: tuple[str, ...] = field(default=())

    @property
    def peak_bytes(self) -> int:
        """The largest device's peak: what must fit."""
        return max(d.peak_bytes for d in self.per_device)

    @property
    def imbalance(self) -> float:
        """max/min peak over the devices (1.0: balanced)."""
        peaks = [d.peak_bytes for d in self.per_device]
        return max(peaks) / min(peaks) if min(peaks) > 0 else 1.0

    @property
    def first_over_others(self) -> float:
        """The first device's tensors over the others' mean (1.0: alike; dp gathers the
        outputs and computes the loss on the first)."""
        tensors = [d.tensor_bytes for d in self.per_device]
        if len(tensors) < 2:
            return 1.0
        others = sum(tensors[1:]) / (len(tensors) - 1)
        return tensors[0] / others if others else 1.0

    @property
    def fits(self) -> bool | None:
        """Whether the largest device's peak fits its memory (None: capacity unknown)."""
        return None if self.capacity_bytes is None else self.peak_bytes <= self.capacity_bytes

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all devices."""
        return self.micro_batch * self.accumulate * self.data_parallel

    @property
    def data_parallel(self) -> int:
        """Devices reading different samples (all of them, for the planned strategies)."""
        return self.devices

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields ``gpukit plan --json`` prints for each plan."""
        first = self.per_device[0]
        return {
            "strategy": self.strategy,
            "devices": self.devices,
            "micro_batch": self.micro_batch,
            "accumulate": self.accumulate,
            "global_batch": self.global_batch,
            "precision": self.precision,
            "activation_checkpointing": self.activation_checkpointing,
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "imbalance": self.imbalance,
            "first_over_others": self.first_over_others,
            "breakdown": max(self.per_device, key=lambda d: d.peak_bytes).to_dict()["breakdown"],
            "per_device": [d.to_dict() for d in self.per_device],
            **(self.step_time.to_dict() if self.step_time else {"step_time_s": None}),
            "samples_per_s": self.samples_per_s,
            "mfu": self.mfu,
            "capacity_bytes": self.capacity_bytes,
            "fits": self.fits,
            "largest_micro_batch": self.largest_micro_batch,
            "notes": list(self.notes),
            "first_device_peak_bytes": first.peak_bytes,
        }
