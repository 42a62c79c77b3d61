"""The data side of a run: the device-aware loader (``loader``: ``DeviceLoader``), which
sampler it iterates (``sampling``), and which samples a sharding sampler repeated
(``padding``).

This package's ``__init__`` imports nothing, so that importing one module loads only it.
"""
