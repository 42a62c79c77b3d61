"""The training runtime: the one small object a training loop talks to, and its parts.

``runtime`` (the thin ``Runtime``), ``config`` (its frozen settings), ``state`` (what a run
has: models, optimizers, loaders, counters), ``step`` (one optimizer step in micro-batches, with
out-of-memory retry), ``metrics`` (values kept on the device, read back once per flush),
``precision``, ``data`` (the device-aware loader), ``collectives``, ``targets`` (loss-target
checks), ``step_hooks`` (what the step calls at its boundaries), and, until they move to a
launch package of their own, the process starters ``launch`` and ``agent``. Checkpoints are
:mod:`gpukit.checkpoint`; the run's boundaries, :mod:`gpukit.lifecycle`.
"""

from gpukit.runtime.runtime import Runtime

__all__ = ["Runtime"]
