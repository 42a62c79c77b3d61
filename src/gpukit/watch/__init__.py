"""Watching a job from outside it, by reading the files its launcher writes: ``gpukit top``
(every rank of a running job, live) and ``gpukit report`` (one HTML page of a run).

Reading only: nothing here writes into a job's folder, takes its locks or signals its
processes, so watching can neither slow a job nor stop it.
"""

from gpukit.watch.jobs import find_job, read_view
from gpukit.watch.live import watch
from gpukit.watch.screen import screen

__all__ = ["find_job", "read_view", "screen", "watch"]
