"""The data side of a run: the device-aware loader (``loader``: ``DeviceLoader``), which
sampler it iterates (``sampling``), Accelerate's order of whole batches dealt to the ranks
(``dealing``, for ``data_order="accelerate"``), and which samples a sharding sampler repeated
(``padding``).

This package's ``__init__`` imports nothing, so that importing one module loads only it.
"""
