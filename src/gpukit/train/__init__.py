"""``gpukit train``: the application that trains a workload with a Runtime on every rank.

``loop`` (the ready-made training loop: progress, periodic checkpoints, exact resume),
``report`` (``metrics.json``, ``metrics.csv`` and ``loss.png``, and the devices' memory) and
``outdir`` (the ``--out`` folder, claimed and checked before anything starts).
"""
