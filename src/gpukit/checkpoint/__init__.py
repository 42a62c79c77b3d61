"""Checkpoints that resume a run exactly, and that a crash, a kill or a bad value never loses.

A checkpoint is a folder ``step-00000123/`` under the directory given, holding:

- ``model.safetensors`` (or ``model-N.safetensors`` for several models): the weights;
  under fsdp, beyond 5 GB, Hugging Face's shards of it and its ``.index.json`` (see
  :mod:`~gpukit.checkpoint.export`);
- ``state.pt``: optimizer and gradient-scaler state, epoch, step, each loader's position
  inside its epoch (in batches, with their size, so another batch size resumes at the same
  sample), and the RNG states of every rank, with the state each loader's pass started from
  (the resumed pass redoes that start's draws: its order and its workers' seeds);
- under fsdp, ``sharded/``: every rank's shards of the weights and optimizer states, written
  by torch.distributed.checkpoint (loadable onto any number of ranks; ``state.pt`` then holds
  no optimizer state; see :mod:`~gpukit.checkpoint.sharded`);
- ``manifest.json``, written last: the format, the step, whether every value was finite, and
  each file's size and sha256.

Saving (:func:`save`; rank 0 writes, and under fsdp every rank its shards): into a temporary
folder, every file fsynced, renamed into place, then the file ``latest`` is pointed at it
(written the same way) and the checkpoints beyond the newest ``keep`` are removed, never the
one just written. A checkpoint whose weights, optimizer or scaler state hold NaN or Inf is
written, marked bad in its manifest, with a warning; ``latest`` stays on the last good one
and nothing is pruned.

Loading (:func:`load`) is all or nothing: it verifies every file against the manifest, reads
``state.pt`` with ``weights_only=True`` (a checkpoint holds tensors and plain values and can
never run code), checks the weights' keys, shapes and dtypes, the optimizers' parameter groups
and state shapes, and that no value is NaN or Inf, and only then changes the models,
optimizers, precision, counters, loaders and random states. A ``latest`` naming a missing or
damaged folder falls back to the newest good one, with a warning. Folders written before
manifests existed load without verification.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     print(has_checkpoints(tmp), resumable(tmp))
False None
"""

from gpukit.checkpoint.files import (
    FORMAT,
    LATEST,
    MANIFEST,
    folder,
    has_checkpoints,
    latest,
    newest_step,
    problem,
    resumable,
)
from gpukit.checkpoint.reader import load
from gpukit.checkpoint.sharded import full_state_dict
from gpukit.checkpoint.writer import save

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "folder",
    "full_state_dict",
    "has_checkpoints",
    "latest",
    "load",
    "newest_step",
    "problem",
    "resumable",
    "save",
]
