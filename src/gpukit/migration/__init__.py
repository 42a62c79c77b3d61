"""Moving a program from Accelerate, Lightning Fabric, plain DDP or ``mp.spawn`` to gpukit:
the table of each call and gpukit's spelling of it (``table``), and the reading of a script's
source that finds its calls and the behaviours that will differ (``scan``), behind
``gpukit check`` and docs/migrating.md.

>>> from gpukit.migration import scan_source
>>> scan_source("import torch.distributed as dist\\ndist.barrier()\\n").findings[0].gpukit
'`rt.barrier()`'
"""

from gpukit.migration.scan import Finding, Scan, scan_file, scan_source

__all__ = ["Finding", "Scan", "scan_file", "scan_source"]
