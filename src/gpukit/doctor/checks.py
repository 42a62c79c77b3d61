"""Judge the facts: each function returns the checks of one layer of the stack.

Pure functions of ``SystemInfo``, ``TorchInfo`` and ``NvmlInfo``: no torch or NVML calls here.
"""

from __future__ import annotations

import re

from gpukit._format import format_bytes
from gpukit._nvml import NvmlGpu, NvmlInfo
from gpukit.doctor.probe import SystemInfo, TorchGpu, TorchInfo
from gpukit.doctor.report import Check

MIN_TORCH = (2, 4)
MIN_PYTHON = (3, 10)
INSTALL_CUDA_TORCH = "pip install torch (the default wheel is a CUDA build; see pytorch.org)"


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
        if t.gpus and t.build == "cuda":
            fix = (
                "pip install nvidia-ml-py"
                if "not installed" in (nvml.error or "")
                else "check the driver install: does nvidia-smi work?"
            )
            return Check(
                "nvidia driver",
                "WARN",
                f"NVML unavailable ({nvml.error}): version unknown, showing what torch reports",
                fix,
            )
        return Check("nvidia driver", "OK", f"none found: {nvml.error}")
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
        why = f" — {t.cuda_init_warning.splitlines()[0]}" if t.cuda_init_warning else ""
        return Check(
            "nvidia driver",
            "FAIL",
            f"{detail}: too old for torch's CUDA {t.cuda_runtime}{why}",
            upgrade,
        )
    return Check(
        "nvidia driver",
        "WARN",
        f"{detail}: older than torch's CUDA {t.cuda_runtime}; works through CUDA "
        "minor-version compatibility, but kernels compiled at run time may fail",
        upgrade,
    )


def gpu_checks(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> list[Check]:
    """Which GPUs torch sees (and why it misses any), then one check per visible GPU."""
    checks = [_visibility_check(t, nvml, env)]
    matched = match_gpus(t, nvml, env)
    for gpu in t.gpus:
        checks.append(_gpu_check(gpu, matched.get(gpu.index), t))
    return checks


def match_gpus(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> dict[int, NvmlGpu]:
    """torch index -> the NVML GPU it is: by UUID, else through CUDA_VISIBLE_DEVICES indices."""
    if not nvml.available or not t.gpus:
        return {}
    by_uuid = {g.uuid: g for g in nvml.gpus if g.uuid}
    if all(gpu.uuid in by_uuid for gpu in t.gpus):
        return {gpu.index: by_uuid[gpu.uuid] for gpu in t.gpus if gpu.uuid}
    visible = env.get("CUDA_VISIBLE_DEVICES")
    order = list(range(len(nvml.gpus)))
    if visible is not None:
        tokens = [p.strip() for p in visible.split(",") if p.strip()]
        if not all(p.isdigit() for p in tokens):
            return {}
        order = [int(p) for p in tokens]
    return {i: nvml.gpus[n] for i, n in enumerate(order[: len(t.gpus)]) if n < len(nvml.gpus)}


def _visibility_check(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> Check:
    seen = len(t.gpus)
    names = ", ".join(f"cuda:{g.index} {g.name}" for g in t.gpus)
    present = len(nvml.gpus) if nvml.available and t.build != "rocm" else None
    if not present or seen >= present:
        if seen:
            return Check("gpus", "OK", f"torch sees {seen}: {names}")
        return Check(
            "gpus",
            "WARN",
            "no GPU, gpukit runs on CPU",
            "nothing to do for CPU training; for a GPU, install its driver",
        )
    listed = ", ".join(f"{g.index}: {g.name}" for g in nvml.gpus)
    if t.build == "cpu":
        return Check(
            "gpus",
            "FAIL",
            f"NVML sees {present} NVIDIA GPU{'s' if present > 1 else ''} ({listed}), "
            f"but this torch build ({t.version}) is CPU-only",
            INSTALL_CUDA_TORCH,
        )
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        if seen == 0 and visible.strip() in ("", "-1"):
            return Check(
                "gpus",
                "WARN",
                f"CUDA_VISIBLE_DEVICES={visible!r} hides all {present} GPUs ({listed}); "
                "gpukit runs on CPU",
                "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (e.g. 0,1)",
            )
        if seen == 0:
            return Check(
                "gpus",
                "WARN",
                f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU of this machine ({listed})",
                f"use indices 0..{present - 1} or the GPUs' UUIDs",
            )
        shown = set(id(g) for g in match_gpus(t, nvml, env).values())
        hidden = ", ".join(f"{g.index}: {g.name}" for g in nvml.gpus if id(g) not in shown)
        return Check(
            "gpus",
            "OK",
            f"torch sees {seen} of {present} ({names}); CUDA_VISIBLE_DEVICES="
            f"{visible!r} hides {hidden or 'the others'}",
        )
    why = f": {t.cuda_init_warning.splitlines()[0]}" if t.cuda_init_warning else ""
    return Check(
        "gpus",
        "FAIL",
        f"torch sees {seen} of the {present} GPUs NVML reports{why}",
        "see the 'nvidia driver' check; `nvidia-smi` must list the GPUs",
    )


def _gpu_check(gpu: TorchGpu, nv: NvmlGpu | None, t: TorchInfo) -> Check:
    name = f"gpu cuda:{gpu.index}"
    free = nv.memory_free if nv and nv.memory_free is not None else gpu.free_memory
    used = (
        nv.memory_used
        if nv and nv.memory_used is not None
        else (gpu.total_memory - free if free is not None else None)
    )
    util = f"{nv.utilization}%" if nv and nv.utilization is not None else "?"
    cc = f"{gpu.capability[0]}.{gpu.capability[1]}"
    detail = (
        f"{gpu.name}, {format_bytes(gpu.total_memory)} total, {format_bytes(used)} used, "
        f"{format_bytes(free)} free, compute {cc}, utilisation {util}"
    )
    if t.build == "cuda" and not has_kernels(gpu.capability, t.arch_list):
        return Check(
            name,
            "FAIL",
            f"{detail}; this torch build has no kernels for sm_{cc.replace('.', '')} "
            f"(it has {' '.join(t.arch_list)})",
            "install a torch build that supports this GPU (often a newer torch, or one "
            "built for a newer CUDA)",
        )
    if gpu.alloc_error:
        return Check(
            name,
            "FAIL",
            f"{detail}; test allocation failed: {gpu.alloc_error}",
            "`nvidia-smi` shows whether the GPU is in a bad state or full",
        )
    if free is not None and free < 0.05 * gpu.total_memory:
        return Check(
            name,
            "WARN",
            f"{detail}; nearly full",
            "other processes hold its memory: `nvidia-smi` lists them",
        )
    return Check(name, "OK", f"{detail}; test allocation ok")


def has_kernels(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether a build with ``arch_list`` (``torch.cuda.get_arch_list()``) runs on ``capability``.

    Machine code (``sm_XY``) runs on the same major version at an equal or newer minor one; PTX
    (``compute_XY``) is compiled at load time for any newer GPU; ``sm_90a``-style code runs
    only on exactly that GPU.

    >>> has_kernels((8, 9), ("sm_80", "sm_86"))
    True
    >>> has_kernels((12, 0), ("sm_80", "sm_90"))
    False
    """
    if not arch_list:
        return True  # unknown: do not accuse the build
    for arch in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+)([a-z]?)", arch)
        if not m:
            continue
        built = (int(m[2]) // 10, int(m[2]) % 10)
        if m[3]:
            runs = built == capability
        elif m[1] == "sm":
            runs = built[0] == capability[0] and built[1] <= capability[1]
        else:
            runs = built <= capability
        if runs:
            return True
    return False
