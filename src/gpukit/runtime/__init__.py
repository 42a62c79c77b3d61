"""The training runtime: the one small object a training loop talks to, and its parts.

``runtime`` (the thin ``Runtime``), ``config`` (its frozen settings), ``state`` (what a run
has: models, optimizers, loaders, counters), ``step`` (one optimizer step in micro-batches, with
out-of-memory retry), ``metrics`` (values kept on the device, read back once per flush),
``precision``, ``data`` (the device-aware loader), ``checkpoint``, ``launch`` (processes),
``targets`` (loss-target checks) and ``faults`` (injected failures for tests and drills).
"""

from gpukit.runtime.runtime import Runtime

__all__ = ["Runtime"]
