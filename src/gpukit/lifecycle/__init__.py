"""The run's boundaries, beside the step itself: what happens before the first step, between
steps and at the end.

``boundaries`` (the :class:`~gpukit.lifecycle.boundaries.Lifecycle` the Runtime owns: periodic
checkpoints, resuming by itself, the stop at an agreed step), ``preemption`` (SIGTERM and Ctrl-C
turned into one coordinated save on every rank); it writes the heartbeat and fires the faults
of ``gpukit.launch``. The step reaches them only through the hooks it declares in
:mod:`gpukit.runtime.step.boundaries`, which :class:`~gpukit.lifecycle.boundaries.Lifecycle`
has without importing the runtime.
"""
