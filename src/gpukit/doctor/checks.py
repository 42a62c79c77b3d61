"""Judge the facts of the software stack: system, torch build and the NVIDIA driver.

Pure functions of ``SystemInfo``, ``TorchInfo`` and ``NvmlInfo``: no torch or NVML calls here.
"""

from __future__ import annotations

import re

from gpukit._util.text import format_bytes
from gpukit.devices.nvml import NvmlInfo
from gpukit.doctor.probe import SystemInfo, TorchInfo
from gpukit.doctor.report import Check

MIN_TORCH = (2, 4)
MIN_PYTHON = (3, 10)


def system_checks(sys_info: SystemInfo, torch_threads: int) -> list[Check]:
    """OS, Python, CPU cores and RAM."""
    py = ".".join(map(str, sys_info.python))
    checks = [Check("os", "OK", sys_info.os)]
    if sys_info.python[:2] >= MIN_PYTHON:
        checks.append(Check("python", "OK", py))
    else:
        checks.append(
            Check(
                "python", "WARN", f"{py} is older than gpukit supports", "use Python 3.10 or newer"
            )
        )
    cpu = (
        f"{sys_info.cores} logical cores, {sys_info.usable_cores} usable by this process, "
        f"torch uses {torch_threads} threads"
    )
    if torch_threads > sys_info.usable_cores:
        checks.append(
            Check(
                "cpu",
                "WARN",
                cpu + " (more threads than cores: they contend)",
                f"torch.set_num_threads({sys_info.usable_cores}) or set OMP_NUM_THREADS",
            )
        )
    else:
        checks.append(Check("cpu", "OK", cpu))
    ram = (
        f"{format_bytes(sys_info.ram_total)} total, "
        f"{format_bytes(sys_info.ram_available)} available"
    )
    low = sys_info.ram_available is not None and sys_info.ram_available < 2 * 1024**3
    checks.append(
        Check(
            "ram",
            "WARN" if low else "OK",
            ram,
            "close other programs: data loading needs host memory" if low else "",
        )
    )
    return checks


def torch_checks(t: TorchInfo, gpu_count: int) -> list[Check]:
    """The torch build, its CUDA runtime, cuDNN, NCCL and gloo."""
    checks = []
    version = tuple(int(p) for p in re.findall(r"\d+", t.version)[:2])
    build = {
        "cpu": "CPU-only build",
        "cuda": f"built for CUDA {t.cuda_runtime}",
        "rocm": f"built for ROCm {t.hip_runtime}",
    }[t.build]
    if version >= MIN_TORCH:
        checks.append(Check("torch", "OK", f"{t.version}, {build}"))
    else:
        checks.append(
            Check(
                "torch",
                "FAIL",
                f"{t.version} is older than gpukit supports (2.4)",
                "pip install --upgrade torch",
            )
        )
    if t.build == "cpu":
        checks.append(Check("cuda runtime", "OK", "none: this torch build is CPU-only"))
    else:
        runtime = t.cuda_runtime or t.hip_runtime
        checks.append(Check("cuda runtime", "OK", f"{runtime} (bundled with torch)"))
    checks.append(_cudnn_check(t))
    checks.append(_nccl_check(t, gpu_count))
    if not t.distributed:
        checks.append(
            Check(
                "gloo",
                "WARN",
                "torch.distributed is not in this build",
                "ddp needs it: install torch from PyPI",
            )
        )
    elif not t.gloo:
        checks.append(
            Check(
                "gloo",
                "WARN",
                "gloo backend missing: ddp on CPU cannot run",
                "install torch from PyPI",
            )
        )
    else:
        checks.append(Check("gloo", "OK", "available (distributed training on CPU)"))
    return checks


def _cudnn_check(t: TorchInfo) -> Check:
    if t.build == "cpu":
        return Check("cudnn", "OK", "none: not in a CPU-only build")
    if t.cudnn_error:
        return Check(
            "cudnn",
            "FAIL",
            t.cudnn_error.splitlines()[0],
            "another cuDNN is loaded than torch was built with: unset LD_LIBRARY_PATH "
            "entries that point at a cuDNN, or pip install --force-reinstall torch",
        )
    if t.cudnn_version is None:
        return Check(
            "cudnn",
            "WARN",
            "cuDNN not found: convolutions will be slow",
            "pip install --force-reinstall torch",
        )
    v = t.cudnn_version
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    text = f"{major}.{rest // 100}.{rest % 100} ({v})"
    if not t.cudnn_enabled:
        return Check(
            "cudnn",
            "WARN",
            f"{text}, disabled by torch.backends.cudnn.enabled=False",
            "remove that line unless you need it",
        )
    return Check("cudnn", "OK", f"{text}, enabled")


def _nccl_check(t: TorchInfo, gpu_count: int) -> Check:
    if t.build == "cpu":
        return Check("nccl", "OK", "none: not in a CPU-only build (CPU training uses gloo)")
    if t.nccl:
        return Check("nccl", "OK", f"{t.nccl_version or 'version unknown'}, available")
    if gpu_count > 1:
        return Check(
            "nccl",
            "WARN",
            "NCCL missing: ddp across GPUs falls back to gloo (slower)",
            "expected on Windows; elsewhere install torch from PyPI",
        )
    return Check("nccl", "OK", "not available (needed only for several GPUs)")


def driver_check(t: TorchInfo, nvml: NvmlInfo) -> Check:
    """The NVIDIA driver, and whether it is new enough for torch's CUDA runtime."""
    if not nvml.available:
        return _driver_without_nvml(t, nvml)
    supports = nvml.cuda_driver_version
    detail = f"{nvml.driver_version}"
    if supports:
        detail += f", supports CUDA up to {supports[0]}.{supports[1]}"
    if t.build != "cuda" or not t.cuda_runtime or not supports:
        return Check("nvidia driver", "OK", detail)
    needed = tuple(int(p) for p in t.cuda_runtime.split(".")[:2])
    if needed <= supports:
        return Check("nvidia driver", "OK", f"{detail} (torch needs {t.cuda_runtime})")
    upgrade = (
        f"upgrade the NVIDIA driver to one for CUDA {t.cuda_runtime}, or install a torch "
        f"built for CUDA {supports[0]}.x"
    )
    if needed[0] > supports[0]:
        return Check(
            "nvidia driver",
            "FAIL",
            f"{detail}: too old for torch's CUDA {t.cuda_runtime}{init_warning(t)}",
            upgrade,
        )
    return Check(
        "nvidia driver",
        "WARN",
        f"{detail}: older than torch's CUDA {t.cuda_runtime}; works through CUDA "
        "minor-version compatibility, but kernels compiled at run time may fail",
        upgrade,
    )


def _driver_without_nvml(t: TorchInfo, nvml: NvmlInfo) -> Check:
    if nvml.absence == "error":
        # The library is there but will not start: after a driver upgrade without a reboot
        # the kernel module and libnvidia-ml differ ("Driver/library version mismatch").
        return Check(
            "nvidia driver",
            "FAIL",
            f"NVML fails: {nvml.error}{init_warning(t)}",
            "reboot, or reinstall the NVIDIA driver so its kernel module and libraries match",
        )
    if t.build == "cuda" and (t.gpus or t.unreadable):
        fix = (
            "pip install nvidia-ml-py"
            if nvml.absence == "no-package"
            else "check the driver install: does nvidia-smi work?"
        )
        return Check(
            "nvidia driver",
            "WARN",
            f"NVML unavailable ({nvml.error}): version unknown, showing what torch reports",
            fix,
        )
    return Check("nvidia driver", "OK", f"none found: {nvml.error}")


def init_warning(t: TorchInfo) -> str:
    return f" — {t.cuda_init_warning.splitlines()[0]}" if t.cuda_init_warning else ""
