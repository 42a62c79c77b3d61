"""The capacity planner: each device's peak memory and the step time, per strategy and device
count, predicted before a run (``gk.plan``, ``gpukit plan``); and the counter of live tensors
that ``gpukit train`` measures the same quantity with."""
