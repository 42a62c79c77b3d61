"""``gpukit train``: the application that trains a workload with a Runtime on every rank.

``loop`` (the ready-made training loop: progress, periodic checkpoints, exact resume),
``validation`` (the held-out pass at each epoch's end), ``report`` (``metrics.json``,
``metrics.csv`` and ``loss.png``, and the devices' memory), ``rerun`` (``config.toml``, the
flags that make a run again) and ``outdir`` (the ``--out`` folder, claimed and checked before
anything starts).
"""
