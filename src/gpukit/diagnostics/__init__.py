"""Seeing what a program does on its devices, and explaining what went wrong.

``placement`` (where parameters and buffers live), ``oplog`` and ``oplog_summary`` (every op
and its device), ``trace`` (host<->device copies and hidden synchronisations), ``memory``
(per-device memory report), ``oom`` (out-of-memory messages explained), ``readable`` and
``rules`` (raw CUDA/NCCL/gloo errors turned into readable ones).
"""
