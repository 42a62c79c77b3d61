"""The run's boundaries, beside the step itself: what happens before the first step, between
steps and at the end.

``boundaries`` (the :class:`~gpukit.lifecycle.boundaries.Lifecycle` the Runtime owns: periodic
checkpoints, resuming by itself, the stop at an agreed step), ``preemption`` (SIGTERM and Ctrl-C
turned into one coordinated save on every rank), ``heartbeat`` (where each rank is, for the
launcher's hang watch) and ``faults`` (failures injected on purpose, to rehearse recovery).
The step reaches them only through the hooks of :mod:`gpukit.runtime.step.boundaries`.
"""
