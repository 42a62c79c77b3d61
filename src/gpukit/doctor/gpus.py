"""Judge the GPUs: which ones torch sees (and why it misses any), and each one's health.

Pure functions of ``TorchInfo`` and ``NvmlInfo``: no torch or NVML calls here.
"""

from __future__ import annotations

import re

from gpukit._util.text import format_bytes
from gpukit.devices.nvml import NvmlGpu, NvmlInfo
from gpukit.doctor.checks import init_warning
from gpukit.doctor.probe import TorchGpu, TorchInfo
from gpukit.doctor.report import Check

INSTALL_CUDA_TORCH = "pip install torch (the default wheel is a CUDA build; see pytorch.org)"


def gpu_checks(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> list[Check]:
    """Which GPUs torch sees (and why it misses any), then one check per visible GPU."""
    checks = [_visibility_check(t, nvml, env)]
    matched = match_gpus(t, nvml, env)
    for gpu in t.gpus:
        checks.append(_gpu_check(gpu, matched.get(gpu.index), t))
    for index, error in t.unreadable:
        checks.append(
            Check(
                f"gpu cuda:{index}",
                "FAIL",
                f"CUDA cannot start on it: {error}",
                "`nvidia-smi` shows whether another process holds it (exclusive compute mode), "
                "it has ECC errors, or it needs a reset by an administrator",
            )
        )
    return checks


def match_gpus(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> dict[int, NvmlGpu]:
    """torch index -> the NVML GPU it is.

    By UUID where torch gives one; otherwise by position only where the numbering is
    unambiguous (one GPU model, or CUDA_DEVICE_ORDER=PCI_BUS_ID): CUDA numbers mixed models
    fastest first, NVML by PCI bus. A GPU left unmatched shows torch's numbers instead.
    """
    if not nvml.available or not t.gpus:
        return {}
    by_uuid = {_bare_uuid(g.uuid): g for g in nvml.gpus if g.uuid}
    if any(gpu.uuid for gpu in t.gpus):
        return {
            gpu.index: by_uuid[_bare_uuid(gpu.uuid)]
            for gpu in t.gpus
            if gpu.uuid and _bare_uuid(gpu.uuid) in by_uuid
        }
    one_model = len({g.name for g in nvml.gpus}) == 1
    if not one_model and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return {}
    order = _visible_indices(env.get("CUDA_VISIBLE_DEVICES"), nvml)
    if order is None:
        return {}
    return {g.index: nvml.gpus[order[g.index]] for g in t.gpus if g.index < len(order)}


def _bare_uuid(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def _visible_indices(visible: str | None, nvml: NvmlInfo) -> list[int] | None:
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES names, in its order; None if some token
    is neither an index nor a UUID (prefix) of a GPU NVML lists."""
    if visible is None:
        return list(range(len(nvml.gpus)))
    found = []
    for token in (p.strip() for p in visible.split(",") if p.strip()):
        if token.isdigit() and int(token) < len(nvml.gpus):
            found.append(int(token))
            continue
        hits = [
            g.index
            for g in nvml.gpus
            if g.uuid
            and _bare_uuid(g.uuid).startswith(_bare_uuid(token))
            and len(_bare_uuid(token)) >= 4
        ]
        if len(hits) != 1:
            return None
        found.append(hits[0])
    return found


def _visibility_check(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> Check:
    seen = len(t.gpus) + len(t.unreadable)
    names = ", ".join(f"cuda:{g.index} {g.name}" for g in t.gpus)
    if t.unreadable:
        names = ", ".join(
            filter(None, [names, *(f"cuda:{i} (cannot start)" for i, _ in t.unreadable)])
        )
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
        named = _visible_indices(visible, nvml)
        if seen == 0 and visible.strip() in ("", "-1"):
            return Check(
                "gpus",
                "WARN",
                f"CUDA_VISIBLE_DEVICES={visible!r} hides all {present} GPUs ({listed}); "
                "gpukit runs on CPU",
                "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (e.g. 0,1)",
            )
        if seen == 0 and not named:
            return Check(
                "gpus",
                "WARN",
                f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU of this machine ({listed})",
                f"use indices 0..{present - 1} or the GPUs' UUIDs",
            )
        if named is None or seen >= len(named):
            hidden = ", ".join(
                f"{g.index}: {g.name}" for g in nvml.gpus if named and g.index not in named
            )
            return Check(
                "gpus",
                "OK",
                f"torch sees {seen} of {present} ({names}); CUDA_VISIBLE_DEVICES={visible!r} "
                f"hides {hidden or 'the others'}",
            )
        # The variable names real GPUs, yet torch sees fewer: CUDA itself failed to start.
    return Check(
        "gpus",
        "FAIL",
        f"torch sees {seen} of the {present} GPUs NVML reports{init_warning(t)}",
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
    return Check(name, "OK", f"{detail}; test allocation {gpu.allocation}")


def has_kernels(capability: tuple[int, int], arch_list: tuple[str, ...]) -> bool:
    """Whether a build with ``arch_list`` (``torch.cuda.get_arch_list()``) runs on ``capability``.

    Machine code (``sm_XY``) runs on the same major version at an equal or newer minor one; PTX
    (``compute_XY``) is compiled at load time for any newer GPU; ``sm_90a``-style code runs
    only on exactly that GPU; family code (``sm_100f``) on its major version from that minor on.

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
        if m[3] == "a":
            runs = built == capability
        elif m[1] == "sm":
            runs = built[0] == capability[0] and built[1] <= capability[1]
        else:
            runs = built <= capability
        if runs:
            return True
    return False
