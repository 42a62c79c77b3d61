"""The capacity planner: each device's peak memory and the step time, per strategy and device
count, predicted before a run (``gk.plan``, ``gpukit plan``). It counts with the live-tensor counter
of :mod:`gpukit.diagnostics.live_tensors`, the one ``gpukit train`` measures with."""
