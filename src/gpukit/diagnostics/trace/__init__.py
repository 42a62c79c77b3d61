"""Where a program copies between host and device, and where it makes the host wait for one.

``with trace() as t:`` records, in this thread, every host<->device copy and every hidden
synchronisation (``.item()``, ``print(t)``, ``if t:``, ``.nonzero()``, a blocking ``.cpu()``...),
each attributed to the user's source line; ``t.report()`` ranks them by estimated cost, with a
fix for each. On a CPU-only run nothing waits, but the same lines would on a GPU: those are
reported as potential (``synchronised=False``).

>>> import torch
>>> from gpukit.diagnostics.trace import trace
>>> with trace() as t:
...     x = torch.ones(3)
...     total = x.sum().item()
>>> [(s.op, s.count, s.device, s.synchronised) for s in t.syncs]
[('item', 1, 'cpu', False)]
>>> t.ops_per_device["cpu"] >= 2
True

How: a ``TorchDispatchMode`` counts every aten op per device and looks closer only at the few
that copy across devices or read data back (one dict lookup per op). Entry points that never
reach the dispatcher, or reach it as many inner ops, are wrapped while a trace is active:
``Tensor.item/tolist/numpy/__bool__/__float__/__int__/__index__/__repr__/__str__/__format__``,
``torch.tensor/as_tensor/asarray`` and ``Tensor.new_tensor`` (a list copied to a device),
``torch.cuda.synchronize``, ``torch.accelerator.synchronize`` and
``torch.cuda.Stream/Event.synchronize``. A thread-local
guard makes one ``print(loss)`` one "print", not also the ``item()`` it does inside.

Attribution goes to the innermost Python frame of the user's own code: not a library's (torch,
numpy, anything installed in a ``site-packages`` or ``dist-packages`` folder, the standard
library with its frozen modules), and not gpukit's, except ``gpukit/train/`` and
``gpukit/workloads/`` (the loop and models ``gpukit trace --workload`` runs are user code) and
the bench's nanoGPT-style loop.
Not reported: copies to or from the ``meta`` device (no data moves; tests treat it as a device
through ``records._IGNORED_DEVICE_TYPES``); reads of CPU tensors by ``torch.optim`` (step
counters) and ``torch.utils.data`` (samplers' random numbers), which stay on the CPU on GPU runs
too; a CPU tensor used as a Python index (``data[i : i + n]`` of a numpy array at
``torch.randint`` offsets), host work on any run; and, once an op ran on an accelerator, every
read of a CPU tensor, which is host work there.
A trace entered inside another (in the same thread) sees what the outer one sees while it is
active; a process forked during a trace (a DataLoader worker) records nothing.

The modules, each importing only those listed before it: ``where`` (the user's line),
``records`` (what is counted, and the thread's state), ``report`` (the text),
``dispatch`` (the mode), ``entries`` (the wrapped entry points), ``session`` (``Trace``).
"""

from gpukit.diagnostics.trace.records import Sync, Transfer, TransferKind
from gpukit.diagnostics.trace.session import Trace, trace, untraced

__all__ = ["Sync", "Trace", "Transfer", "TransferKind", "trace", "untraced"]
