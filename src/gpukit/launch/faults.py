"""Failures injected on purpose, to test and rehearse recovery without the hardware to cause
them.

- ``GPUKIT_FAULT_OOM_ABOVE=N`` makes every micro-batch of more than N samples raise a real
  ``torch.OutOfMemoryError``, whose message reads like the own of the allocator of the device
  the run computes on (a CUDA GPU's, the CPU's, MPS's).
- ``GPUKIT_FAULT=KIND:RANK:STEP[,KIND:RANK:STEP...]`` makes rank RANK fail as KIND says when
  it begins optimizer step STEP (counted from 1): ``raise`` (a RuntimeError), ``exit``
  (``os._exit(3)``: no Python error, no cleanup), ``sigkill`` (the process kills itself: what
  the kernel's out-of-memory killer does), ``hang`` (sleeps forever: a stuck collective, a dead
  filesystem), ``sigterm`` (sends itself SIGTERM: a scheduler's preemption) or ``nan`` (that
  step's loss is NaN on that rank). Each fault fires once per job: under gpukit's launcher, a
  restarted attempt that resumes before STEP and reaches it again does not fire it again (what
  fired is written to the job's folder), so a spec with several faults exercises several
  restarts. On several nodes, the launchers share what fired at the end of every attempt
  (each node's job folder gets the markers of all), so a fault fires once per job wherever the
  rank it names runs next.

>>> err = injected_oom(64, 32)
>>> from gpukit.diagnostics.oom_message import is_oom, parse
>>> is_oom(err), parse(str(err)).requested == 64 * 2**20
(True, True)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpukit import _env
from gpukit.diagnostics.oom_message import OOM_ERROR
from gpukit.errors import ConfigError

KINDS = ("raise", "sigkill", "exit", "hang", "sigterm", "nan")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind`` on ``rank`` when it begins step ``step``; ``index`` is its
    place in the spec (what marks it fired)."""

    kind: str
    rank: int
    step: int
    index: int


def parse_faults(spec: str) -> list[Fault]:
    """``GPUKIT_FAULT``'s value as faults; ConfigError naming the part that is wrong.

    >>> parse_faults("sigkill:1:6,raise:0:11")[1]
    Fault(kind='raise', rank=0, step=11, index=1)
    """
    faults = []
    for index, part in enumerate(p.strip() for p in spec.split(",")):
        fields = part.split(":")
        ok = (
            len(fields) == 3
            and fields[0] in KINDS
            and all(f.isascii() and f.isdigit() for f in fields[1:])
            and int(fields[2]) >= 1
        )
        if not ok:
            raise ConfigError(
                f"GPUKIT_FAULT={spec!r}: {part!r} is not KIND:RANK:STEP with KIND one of "
                f"{', '.join(KINDS)}, RANK a rank (0, 1, ...) and STEP an optimizer step from "
                "1 on; e.g. GPUKIT_FAULT=sigkill:1:6,raise:0:11 (or unset it)"
            )
        faults.append(Fault(fields[0], int(fields[1]), int(fields[2]), index))
    return faults


class FaultPlan:
    """The faults of ``GPUKIT_FAULT`` for this rank, fired by :meth:`step_begins`.

    Checking costs one dictionary lookup per step; a rank with no fault has an empty plan.
    """

    def __init__(self, faults: list[Fault], rank: int, job_dir: Path | None) -> None:
        self.pending = {f.step: f for f in faults if f.rank == rank}
        self.job_dir = job_dir
        self.nan_now = False  # the loss of the current step becomes NaN

    @classmethod
    def from_env(cls, rank: int) -> FaultPlan:
        spec = _env.fault_spec()
        return cls(parse_faults(spec) if spec else [], rank, _env.job_dir())

    def step_begins(self, step: int) -> None:
        """Rank begins optimizer step ``step`` (from 1): fire its fault there, if any."""
        self.nan_now = False
        fault = self.pending.pop(step, None) if self.pending else None
        if fault is None or not self._first_time(fault):
            return
        if fault.kind == "nan":
            self.nan_now = True
            return
        where = f"injected by GPUKIT_FAULT: {fault.kind} on rank {fault.rank} at step {step}"
        if fault.kind == "raise":
            raise RuntimeError(where)
        if fault.kind == "exit":
            os._exit(3)
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        while True:  # hang
            time.sleep(3600)

    def _first_time(self, fault: Fault) -> bool:
        """Mark ``fault`` fired for the whole job; False when an earlier attempt fired it."""
        if self.job_dir is None:
            return True
        marker = self.job_dir / f"fault-{fault.index}.fired"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True


def fired(job_dir: Path) -> list[str]:
    """The markers of the faults that fired in this job, as ``FaultPlan`` leaves them."""
    return sorted(p.name for p in job_dir.glob("fault-*.fired"))


def mark_fired(job_dir: Path, names: list[str]) -> None:
    """Mark fired the faults that fired elsewhere (another node's markers, from ``fired``)."""
    for name in names:
        if name.startswith("fault-") and name.endswith(".fired") and "/" not in name:
            (job_dir / name).touch()


class OomFault:
    """The out-of-memory fault the environment asks for (``limit`` None: none), raised as the
    allocator of ``device`` (the device the run computes on) words it."""

    def __init__(self, limit: int | None = None, device: torch.device | str = "cuda:0") -> None:
        self.limit, self.device = limit, device

    @classmethod
    def from_env(cls, device: torch.device | str = "cuda:0") -> OomFault:
        return cls(_env.fault_oom_above(), device)

    def check(self, samples: int) -> None:
        """Raise the injected error when a micro-batch of ``samples`` is over the limit."""
        if self.limit is not None and samples > self.limit:
            raise injected_oom(samples, self.limit, self.device)


def injected_oom(samples: int, limit: int, device: torch.device | str = "cuda:0") -> BaseException:
    """A real torch out-of-memory error, as the fault injection GPUKIT_FAULT_OOM_ABOVE raises,
    in the words of ``device``'s allocator (a CUDA GPU's, the CPU's or MPS's), so that the
    explanation names the device the run uses.

    >>> str(injected_oom(4, 2, "cpu")).split(" (injected")[0]
    'DefaultCPUAllocator: not enough memory: you tried to allocate 4194304 bytes.'
    """
    for name, value in (("samples", samples), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"injected_oom({name}={value!r}): give a whole number >= 1")
    dev = torch.device(device)
    total, requested = 16 * 2**30, min(samples * 2**20, 8 * 2**30)  # 1 MiB a sample
    if dev.type == "cpu":
        message = (
            f"DefaultCPUAllocator: not enough memory: you tried to allocate {requested} bytes."
        )
    elif dev.type == "mps":
        message = (
            f"MPS backend out of memory (MPS allocated: {_torch_size(total - 2**30)}, other "
            f"allocations: {_torch_size(2**30)}, max allowed: {_torch_size(total)}). Tried to "
            f"allocate {_torch_size(requested)} on private pool."
        )
    else:  # CUDA (ROCm's torch names its GPUs cuda too)
        message = (
            f"CUDA out of memory. Tried to allocate {_torch_size(requested)}. GPU {dev.index or 0}"
            f" has a total capacity of {_torch_size(total)} of which 0 bytes is free. Of the "
            f"allocated memory {_torch_size(total - 2**30)} is allocated by PyTorch, and 0 bytes "
            "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )
    note = f" (injected by GPUKIT_FAULT_OOM_ABOVE={limit}: a micro-batch of {samples} samples)"
    return OOM_ERROR(message + note)


def _torch_size(n: int) -> str:
    # c10's format_size, so that parse() reads an injected message exactly like a real one.
    if n <= 1024:
        return f"{n} bytes"
    if n <= 2**20:
        return f"{n / 2**10:.2f} KiB"
    return f"{n / 2**20:.2f} MiB" if n <= 2**30 else f"{n / 2**30:.2f} GiB"
