"""The training runtime: the one small object a training loop talks to, and its parts.

At the top: ``runtime`` (the :class:`~gpukit.runtime.runtime.Runtime`, ``gk.Runtime``),
``settings`` (every setting, declared once) with ``settings_checks`` (their checks and the
devices they name) and ``settings_doc``, ``state`` (what a run has: models, optimizers, loaders,
counters), ``owned`` (what ``rt.setup`` and ``rt.track`` are given besides the model),
``checkpointing`` (``rt.save``, ``rt.load``, ``rt.resume``), ``properties`` (what a Runtime
shows about itself), ``strategy_at_setup`` (``strategy="auto"``'s choice at ``rt.setup``),
``schedulers`` and ``compiling``. Its rooms, below the top that assembles them: ``step/`` (one
optimizer step: the stepper, its retry, the non-finite guard, precision, loss checks, the
optimizers setup adopted, and the settings and state it reads as the protocols of ``live``),
``data/`` (the device-aware loader, sampling, padding) and ``outputs/`` (metrics, evaluation,
progress, reporting, profiling). Checkpoints themselves are :mod:`gpukit.checkpoint`; the run's
boundaries, :mod:`gpukit.lifecycle`; its collectives, :mod:`gpukit.strategies.collectives`.

This package's ``__init__`` imports nothing: its modules (the settings, the state) are imported
by the checkpoint and lifecycle packages, which the Runtime imports in turn.
"""
