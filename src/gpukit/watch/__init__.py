"""Watching a job: ``gpukit top`` (its ranks, live) and ``gpukit report`` (one page of a run)."""
