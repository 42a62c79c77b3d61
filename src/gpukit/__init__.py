"""gpukit: deep learning on GPUs made correct, fast and understandable, on top of PyTorch.

>>> import gpukit as gk
>>> dev = gk.device()            # the best device here: GPUKIT_DEVICE, else cuda:0, mps, cpu
>>> x = gk.to({"x": [1, 2]}, dev)
"""

from gpukit import loggers, strategies
from gpukit.devices.device import Device, cpu, device, devices, gpu, on
from gpukit.devices.move import to
from gpukit.diagnostics.memory import MemoryReport, memory
from gpukit.diagnostics.memory_breakdown import MemoryBreakdown
from gpukit.diagnostics.oom import explain
from gpukit.diagnostics.oplog import PlacementLog, log_placement
from gpukit.diagnostics.placement import PlacementReport, placement
from gpukit.diagnostics.readable import explain_error
from gpukit.diagnostics.trace import Trace, trace
from gpukit.errors import (
    CheckpointWriteError,
    ConfigError,
    CrossDeviceError,
    CudnnError,
    DeviceAssertError,
    DeviceError,
    DistributedError,
    DriverTooOldError,
    GpukitError,
    LaunchError,
    LoggerError,
    LoggerWriteError,
    NoKernelImageError,
    NonFiniteError,
    OutOfMemory,
    OutputWriteError,
    Preempted,
    RunComplete,
    ShardedTensorError,
    SimulationUnsupported,
)
from gpukit.planning import auto as _auto  # noqa: F401  (strategy="auto" asks the planner)
from gpukit.planning import auto_layout as _auto_layout  # noqa: F401  (so does parallel="auto")
from gpukit.planning.layout_search import plan_layout
from gpukit.planning.plan_or_layout import plan
from gpukit.runtime.runtime import Runtime
from gpukit.strategies.sequence_batches import sequence_positions, whole_sequences

__version__ = "0.1.0"

__all__ = [
    "CheckpointWriteError",
    "ConfigError",
    "CrossDeviceError",
    "CudnnError",
    "Device",
    "DeviceAssertError",
    "DeviceError",
    "DistributedError",
    "DriverTooOldError",
    "GpukitError",
    "LaunchError",
    "LoggerError",
    "LoggerWriteError",
    "MemoryBreakdown",
    "MemoryReport",
    "NoKernelImageError",
    "NonFiniteError",
    "OutOfMemory",
    "OutputWriteError",
    "PlacementLog",
    "PlacementReport",
    "Preempted",
    "RunComplete",
    "Runtime",
    "ShardedTensorError",
    "SimulationUnsupported",
    "Trace",
    "__version__",
    "cpu",
    "device",
    "devices",
    "explain",
    "explain_error",
    "gpu",
    "log_placement",
    "loggers",
    "memory",
    "on",
    "placement",
    "plan",
    "plan_layout",
    "sequence_positions",
    "strategies",
    "to",
    "trace",
    "whole_sequences",
]
