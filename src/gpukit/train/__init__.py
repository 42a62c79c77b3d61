"""``gpukit train``: the application that trains a workload with a Runtime on every rank.

``options`` (its own options, declared once: flags, config keys, each rank's command line, the
record), ``loop`` (the ready-made training loop: progress, periodic checkpoints, exact resume),
``validation`` (the held-out pass at each epoch's end), ``report`` (``metrics.json``,
``metrics.csv`` and ``loss.png``, and the devices' memory), ``rerun`` (``config.toml``, the
flags that make a run again) and ``outdir`` (the ``--out`` folder, claimed and checked before
anything starts).
"""
