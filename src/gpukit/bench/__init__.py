"""Benchmarks behind ``gpukit bench``: one module per experiment.

Each experiment warms up, repeats, reports medians and ratios measured in the same run (all
timed the same way, by :mod:`gpukit.bench.timing`), and records the machine it ran on (see
:mod:`gpukit.bench.environment`).

>>> from gpukit.bench.overhead import run_overhead
>>> run_overhead(steps=2, rounds=1).variant("plain").ratio
1.0
"""
