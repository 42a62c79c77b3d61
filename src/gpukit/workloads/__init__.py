"""Built-in training workloads: a model, its data and its loss, ready for ``gpukit train``.

``mlp`` (a tiny classifier on synthetic points), ``cnn`` (a small ResNet on synthetic images),
``gpt`` (a character-level transformer on bundled public-domain text) and ``gpt2`` (GPT-2 small
as nanoGPT trains it, on that text's tokens). Any function of yours loads the same way as
``"package.module:function"``; ``gpukit.workloads.llama:llama3_2_1b`` is Llama 3.2 1B's shape.

The modules: ``base`` (:class:`Workload`, :func:`load_workload`), ``flops`` (FLOP counting and
MFU), and one module per built-in workload. The loop that trains them is :mod:`gpukit.train`.

>>> from gpukit.workloads import WORKLOADS, load_workload
>>> WORKLOADS
('mlp', 'cnn', 'gpt', 'gpt2')
>>> load_workload("mlp", seed=1).batch_size
64
"""

from gpukit.workloads.base import WORKLOADS, Workload, WorkloadName, load_workload
from gpukit.workloads.flops import forward_flops

__all__ = ["WORKLOADS", "Workload", "WorkloadName", "forward_flops", "load_workload"]
