"""The training runtime: the one small object a training loop talks to, and its parts.

``runtime`` (the thin :class:`~gpukit.runtime.runtime.Runtime`, ``gk.Runtime``), ``settings``
(every setting, declared once), ``config`` (the settings' checks and the devices they name),
``state`` (what a run has: models, optimizers, loaders, counters), ``step`` (one optimizer
step, in micro-batches) with ``retry`` (what a step retried after running out of memory needs),
``checkpointing`` (``rt.save``, ``rt.load``, ``rt.resume``), ``metrics`` (values kept on the
device, read back once per flush), ``precision``, ``data`` (the device-aware loader),
``collectives``, ``targets`` (loss-target checks), ``step_hooks`` (what the step calls at its
boundaries), and, until they move to a launch package of their own, the process starters
``launch`` and ``agent``. Checkpoints themselves are :mod:`gpukit.checkpoint`; the run's
boundaries, :mod:`gpukit.lifecycle`.

This package's ``__init__`` imports nothing: its modules (the settings, the state) are imported
by the checkpoint and lifecycle packages, which the Runtime imports in turn.
"""
