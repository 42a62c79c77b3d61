"""Failures injected on purpose, to test and rehearse recovery without the hardware to cause
them: ``GPUKIT_FAULT_OOM_ABOVE=N`` makes every micro-batch of more than N samples raise a real
``torch.OutOfMemoryError``, whose message reads like the CUDA allocator's own.

>>> err = injected_oom(64, 32)
>>> from gpukit.diagnostics.oom import is_oom, parse
>>> is_oom(err), parse(str(err)).requested == 64 * 2**20
(True, True)
"""

from __future__ import annotations

from gpukit import _env
from gpukit.diagnostics.oom import OOM_ERROR
from gpukit.errors import ConfigError


class OomFault:
    """The out-of-memory fault the environment asks for (``limit`` None: none)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit

    @classmethod
    def from_env(cls) -> OomFault:
        return cls(_env.fault_oom_above())

    def check(self, samples: int) -> None:
        """Raise the injected error when a micro-batch of ``samples`` is over the limit."""
        if self.limit is not None and samples > self.limit:
            raise injected_oom(samples, self.limit)


def injected_oom(samples: int, limit: int) -> BaseException:
    """A real torch out-of-memory error, as the fault injection GPUKIT_FAULT_OOM_ABOVE raises."""
    for name, value in (("samples", samples), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"injected_oom({name}={value!r}): give a whole number >= 1")
    total, requested = 16 * 2**30, min(samples * 2**20, 8 * 2**30)  # 1 MiB a sample
    message = (
        f"CUDA out of memory. Tried to allocate {_torch_size(requested)}. GPU 0 has a total "
        f"capacity of {_torch_size(total)} of which 0 bytes is free. Of the allocated memory "
        f"{_torch_size(total - 2**30)} is allocated by PyTorch, and 0 bytes is reserved by "
        "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        f" (injected by GPUKIT_FAULT_OOM_ABOVE={limit}: a micro-batch of {samples} samples)"
    )
    return OOM_ERROR(message)


def _torch_size(n: int) -> str:
    # c10's format_size, so that parse() reads an injected message exactly like a real one.
    if n <= 1024:
        return f"{n} bytes"
    if n <= 2**20:
        return f"{n / 2**10:.2f} KiB"
    return f"{n / 2**20:.2f} MiB" if n <= 2**30 else f"{n / 2**30:.2f} GiB"
