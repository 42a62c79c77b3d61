"""``rt.profile``: ``torch.profiler``'s trace of a window of the Runtime's own steps.

The Runtime counts its optimizer steps itself (``rt.step`` calls that stepped, and
``rt.train_step``), so the loop inside ``with rt.profile(...):`` stays as it was, with no
``prof.step()`` to add: :class:`Profiling` follows the steps of the Runtime's stepper. How
the window is written and read: :mod:`gpukit.diagnostics.profiles`.
"""

from __future__ import annotations

import os

from gpukit.diagnostics.profiles import StepProfile
from gpukit.runtime.step.stepper import Stepper
from gpukit.strategies import Strategy


class Profiling:
    """The Runtime's ``rt.profile``: the steps of ``stepper`` on ``strategy``'s rank (the
    Runtime gives it new ones when ``strategy="auto"`` replaces the strategy), named by the
    step of the state it advances."""

    def __init__(self, stepper: Stepper, strategy: Strategy) -> None:
        self.stepper, self.strategy = stepper, strategy

    def profile(
        self,
        folder: str | os.PathLike[str] = "profile",
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        with_stack: bool = False,
    ) -> StepProfile:
        """Profile ``active`` of this Runtime's steps, after ``wait`` untouched and ``warmup``
        profiled-and-dropped ones (``repeat`` such windows), counted from where the block
        begins; each window is written to ``folder`` as ``gpukit_rank{R}.{STEP}.pt.trace.json``
        (Chrome/Perfetto JSON, read by TensorBoard's profiler plugin) and its top ops by self
        time as ``...summary.txt``. Steps are named by ``rt.global_step``; ``record_shapes`` and
        ``with_stack`` go to ``torch.profiler.profile``.

        >>> import tempfile, torch, gpukit as gk
        >>> rt = gk.Runtime(devices="cpu")
        >>> model = torch.nn.Linear(2, 1)
        >>> model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with rt.profile(tempfile.mkdtemp(), wait=1, warmup=1, active=2) as prof:
        ...     for _ in range(5):
        ...         rt.backward(model(torch.ones(4, 2)).mean())
        ...         _ = rt.step(opt)
        >>> [(w.first, w.last) for w in prof.windows]
        [(3, 4)]
        >>> "ProfilerStep" in prof.windows[0].table
        True
        """
        return StepProfile(
            folder,
            wait=wait,
            warmup=warmup,
            active=active,
            repeat=repeat,
            steps="runtime",
            owner=self.stepper,
            rank=self.strategy.rank,
            offset=self.stepper.state.global_step,
            record_shapes=record_shapes,
            with_stack=with_stack,
        )
