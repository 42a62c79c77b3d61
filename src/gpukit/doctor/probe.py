"""Read the facts the doctor checks: the OS, the torch build, and each GPU torch sees.

Reading is kept apart from judging (``checks.py``) so every scenario, a driver too old or a GPU
hidden by ``CUDA_VISIBLE_DEVICES``, can be tested by building these facts by hand.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import warnings
from dataclasses import dataclass, field

import torch

from gpukit.devices import hw as _hw

# Variables that change how CUDA, NCCL or torch behave, shown so a stray one is noticed.
_WATCHED_ENV_PREFIXES = ("CUDA_", "NCCL_", "PYTORCH_", "GPUKIT_", "TORCH_")


@dataclass(frozen=True)
class SystemInfo:
    """The machine outside torch."""

    os: str
    platform: str  # sys.platform: linux, darwin, win32
    python: tuple[int, int, int]
    cores: int
    usable_cores: int
    ram_total: int | None
    ram_available: int | None
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TorchGpu:
    """One GPU as torch sees it, with the outcome of a real test allocation."""

    index: int
    name: str
    total_memory: int
    capability: tuple[int, int]
    uuid: str | None = None
    free_memory: int | None = None
    bf16: bool = False
    alloc_tested: bool = True  # False with `gpukit doctor --no-alloc`
    alloc_error: str | None = None  # None: the test allocation worked (or was not tried)

    @property
    def allocation(self) -> str:
        """``"ok"``, ``"skipped"`` or the error of the test allocation."""
        if not self.alloc_tested:
            return "skipped"
        return self.alloc_error or "ok"


@dataclass(frozen=True)
class TorchInfo:
    """The torch build and what it makes of the GPUs."""

    version: str
    build: str  # cpu, cuda, rocm
    cuda_runtime: str | None = None
    hip_runtime: str | None = None
    cudnn_version: int | None = None
    cudnn_enabled: bool = True
    cudnn_error: str | None = None
    nccl_version: str | None = None
    distributed: bool = True
    gloo: bool = True
    nccl: bool = False
    cuda_available: bool = False
    cuda_init_warning: str | None = None
    arch_list: tuple[str, ...] = ()
    gpus: tuple[TorchGpu, ...] = ()
    unreadable: tuple[tuple[int, str], ...] = ()  # (index, error): CUDA cannot start on it
    p2p: tuple[tuple[bool, ...], ...] = ()  # p2p[i][j]: cuda:i can access cuda:j
    tf32_matmul: bool = False
    mps_built: bool = False
    mps_available: bool = False


def read_system() -> SystemInfo:
    """Facts about the OS, Python, CPU and RAM."""
    cores, usable = _hw.cpu_cores()
    return SystemInfo(
        os=platform.platform(),
        platform=sys.platform,
        python=(sys.version_info.major, sys.version_info.minor, sys.version_info.micro),
        cores=cores,
        usable_cores=usable,
        ram_total=_hw.ram_total(),
        ram_available=_hw.ram_available(),
        env={k: v for k, v in sorted(os.environ.items()) if k.startswith(_WATCHED_ENV_PREFIXES)},
    )


def read_torch(test_allocation: bool = True) -> TorchInfo:
    """Facts about the torch build; touches each GPU with a small allocation if asked."""
    import torch.distributed as dist

    build = _hw.torch_build()
    cuda_available, init_warning = _cuda_available()
    cudnn_version, cudnn_error = _cudnn_version()
    gpus: list[TorchGpu] = []
    unreadable: list[tuple[int, str]] = []
    for i in range(_hw.cuda_count()):
        try:
            gpus.append(_read_gpu(i, test_allocation))
        except Exception as err:  # the doctor must report a GPU that cannot start, not crash
            unreadable.append((i, _first_line(err)))
    return TorchInfo(
        version=torch.__version__,
        build=build,
        cuda_runtime=torch.version.cuda,
        hip_runtime=torch.version.hip,
        cudnn_version=cudnn_version,
        cudnn_enabled=bool(torch.backends.cudnn.enabled),
        cudnn_error=cudnn_error,
        nccl_version=_nccl_version(),
        distributed=dist.is_available(),
        gloo=dist.is_available() and dist.is_gloo_available(),
        nccl=dist.is_available() and dist.is_nccl_available(),
        cuda_available=cuda_available,
        cuda_init_warning=init_warning,
        arch_list=tuple(torch.cuda.get_arch_list()) if build != "cpu" else (),
        gpus=tuple(gpus),
        unreadable=tuple(unreadable),
        p2p=_p2p_matrix([g.index for g in gpus]),
        tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
        mps_built=_hw.mps_built(),
        mps_available=_hw.mps_available(),
    )


def _cuda_available() -> tuple[bool, str | None]:
    """torch.cuda.is_available(), and the warning torch gives when CUDA fails to start."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
    messages = [str(w.message) for w in caught if "CUDA" in str(w.message)]
    return available, (messages[0] if messages else None)


def _cudnn_version() -> tuple[int | None, str | None]:
    # torch raises here when the cuDNN it loads differs from the one it was built against.
    try:
        version = torch.backends.cudnn.version()
    except Exception as err:
        return None, str(err).strip()
    return (int(version) if version else None), None


def _nccl_version() -> str | None:
    if _hw.torch_build() == "cpu":
        return None
    try:
        import torch.cuda.nccl as nccl

        version = nccl.version()
    except Exception:
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def _read_gpu(index: int, test_allocation: bool) -> TorchGpu:
    props = _hw.cuda_properties(index)
    free = None
    with contextlib.suppress(Exception):  # unknown free memory is not worth failing over
        free = int(torch.cuda.mem_get_info(index)[0])
    error = _test_allocation(index) if test_allocation else None
    return TorchGpu(
        index=index,
        name=props.name,
        total_memory=props.total_memory,
        capability=props.capability,
        uuid=props.uuid,
        free_memory=free,
        bf16=props.capability >= (8, 0),
        alloc_tested=test_allocation,
        alloc_error=error,
    )


def _test_allocation(index: int) -> str | None:
    """Allocate 64 MiB, compute on it and read the result back; the error text if that fails."""
    try:
        x = torch.ones(16 * 1024 * 1024, device=f"cuda:{index}")
        total = float(x.sum().item())
        del x
        torch.cuda.empty_cache()
    except Exception as err:
        return f"{type(err).__name__}: {_first_line(err)}"
    if total != 16 * 1024 * 1024:
        return f"wrong result from a test kernel: {total}"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _p2p_matrix(indices: list[int]) -> tuple[tuple[bool, ...], ...]:
    if len(indices) < 2:
        return ()
    return tuple(tuple(i == j or _can_access_peer(i, j) for j in indices) for i in indices)


def _can_access_peer(i: int, j: int) -> bool:
    try:
        return bool(torch.cuda.can_device_access_peer(i, j))
    except Exception:
        return False
