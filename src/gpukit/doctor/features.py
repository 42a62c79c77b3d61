"""Checks of what the GPUs can do together and what the environment changes: peer-to-peer
access, bf16/TF32, GPU numbering, MPS on macOS, CUDA/NCCL variables, and the gpukit variables
that choose the default device or inject faults."""

from __future__ import annotations

from gpukit.devices.nvml import NvmlInfo
from gpukit.devices.spec import AUTO, SpecError, parse
from gpukit.doctor.probe import SystemInfo, TorchInfo
from gpukit.doctor.report import Check


def p2p_check(t: TorchInfo) -> list[Check]:
    """Whether each pair of GPUs can copy directly (NVLink or PCIe peer-to-peer)."""
    if len(t.gpus) < 2:
        return []
    index = [g.index for g in t.gpus]  # p2p rows follow t.gpus, which may skip an index
    missing = [
        f"cuda:{index[i]}->cuda:{index[j]}"
        for i, row in enumerate(t.p2p)
        for j, ok in enumerate(row)
        if i != j and not ok
    ]
    n = len(t.gpus)
    if not missing:
        return [Check("peer-to-peer", "OK", f"all {n} GPUs reach each other directly")]
    return [
        Check(
            "peer-to-peer",
            "WARN",
            f"no direct access for {', '.join(missing)}: copies between them go through host "
            "memory, which slows dp and ddp",
            "`nvidia-smi topo -m` shows the links; on bare metal check IOMMU/ACS settings",
        )
    ]


def precision_check(t: TorchInfo) -> list[Check]:
    """bf16 support per GPU, and whether TF32 matrix products are on."""
    if not t.gpus:
        return []
    with_bf16 = [f"cuda:{g.index}" for g in t.gpus if g.bf16]
    tf32_capable = all(g.capability >= (8, 0) for g in t.gpus)
    if len(with_bf16) == len(t.gpus):
        bf16 = "bf16 on every GPU (bf16-mixed is the mixed precision to use)"
    elif with_bf16:
        bf16 = f"bf16 only on {', '.join(with_bf16)} (16-mixed works everywhere)"
    else:
        bf16 = "no bf16 (compute capability < 8.0): 16-mixed is the mixed precision to use"
    if not tf32_capable:
        tf32 = "TF32 not supported"
    elif t.tf32_matmul:
        tf32 = "TF32 matmul on"
    else:
        tf32 = "TF32 matmul off (torch.set_float32_matmul_precision('high') turns it on)"
    return [Check("precision", "OK", f"{bf16}; {tf32}")]


def order_check(t: TorchInfo, nvml: NvmlInfo, env: dict[str, str]) -> list[Check]:
    """Different GPU models get different numbers in torch and nvidia-smi unless told not to;
    that matters only where this process sees two or more of them."""
    models = {g.name for g in nvml.gpus}
    if len(models) < 2 or len(t.gpus) < 2 or env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return []
    return [
        Check(
            "gpu numbering",
            "WARN",
            f"mixed GPU models ({', '.join(sorted(models))}): CUDA numbers them fastest first, "
            "nvidia-smi by PCI bus, so cuda:N may not be nvidia-smi's GPU N",
            "export CUDA_DEVICE_ORDER=PCI_BUS_ID",
        )
    ]


def mps_check(sys_info: SystemInfo, t: TorchInfo) -> list[Check]:
    """Apple's Metal backend, on macOS only."""
    if sys_info.platform != "darwin":
        return []
    if t.mps_available:
        return [Check("mps", "OK", "Apple GPU available through MPS")]
    if t.mps_built:
        return [
            Check(
                "mps",
                "WARN",
                "MPS is built but unavailable",
                "MPS needs macOS 12.3+ on a Mac with a Metal GPU",
            )
        ]
    return [
        Check(
            "mps",
            "WARN",
            "this torch build has no MPS backend",
            "pip install torch (the macOS arm64 wheel includes MPS)",
        )
    ]


def environment_check(sys_info: SystemInfo) -> list[Check]:
    """CUDA, NCCL, torch and gpukit variables that are set, and the ones that slow things."""
    env = sys_info.env
    shown = ", ".join(f"{k}={v}" for k, v in env.items()) or "none set"
    if env.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return [
            Check(
                "environment",
                "WARN",
                f"{shown}; CUDA_LAUNCH_BLOCKING makes every kernel launch wait (slow)",
                "unset CUDA_LAUNCH_BLOCKING unless you are debugging a CUDA error",
            )
        ]
    return [Check("environment", "OK", shown)]


def default_device_check(sys_info: SystemInfo, t: TorchInfo) -> list[Check]:
    """``GPUKIT_DEVICE``, when set: a device this machine has, or the reason ``gk.device()``
    (and every Runtime with ``devices="auto"``) will fail.

    >>> from gpukit.doctor.probe import read_system, read_torch
    >>> import dataclasses
    >>> facts = dataclasses.replace(read_system(), env={"GPUKIT_DEVICE": "tpu:0"})
    >>> [(c.name, c.status) for c in default_device_check(facts, read_torch(False))]
    [('GPUKIT_DEVICE', 'FAIL')]
    """
    value = sys_info.env.get("GPUKIT_DEVICE", "").strip()
    if not value:
        return []
    unset = "unset GPUKIT_DEVICE (gk.device() then picks cuda:0, else mps, else cpu)"
    try:
        spec = parse(value)
    except SpecError as err:
        return [
            Check(
                "GPUKIT_DEVICE",
                "FAIL",
                f"GPUKIT_DEVICE={value!r} is not a device: {err.problem}; gk.device() fails",
                f"{err.fix}; or {unset}",
            )
        ]
    names = ["cpu", *(f"cuda:{g.index}" for g in t.gpus), *(["mps"] if t.mps_available else [])]
    have = ", ".join(names)
    missing = None
    if spec.kind == "mps" and not t.mps_available:
        missing = "MPS is not available here"
    elif spec.kind == "cuda":
        readable = {g.index for g in t.gpus}
        broken = dict(t.unreadable)
        index = spec.index if spec.index is not None else 0
        if index in broken:
            missing = f"CUDA cannot start on GPU {index}: {broken[index]}"
        elif index not in readable:
            missing = f"there is no GPU {index} (torch sees {len(t.gpus)} GPU(s))"
    if missing is not None:
        return [
            Check(
                "GPUKIT_DEVICE",
                "FAIL",
                f"GPUKIT_DEVICE={value!r}: {missing}; gk.device() fails (this machine has {have})",
                f"set it to one of {have}, or {unset}",
            )
        ]
    shown = "the best device" if spec == AUTO else "it"
    return [Check("GPUKIT_DEVICE", "OK", f"GPUKIT_DEVICE={value!r}: gk.device() picks {shown}")]


def fault_injection_check(sys_info: SystemInfo) -> list[Check]:
    """Fault injection left on by mistake makes a healthy run fail on purpose.

    >>> from gpukit.doctor.probe import read_system
    >>> import dataclasses
    >>> facts = dataclasses.replace(read_system(), env={"GPUKIT_FAULT_OOM_ABOVE": "8"})
    >>> [c.status for c in fault_injection_check(facts)]
    ['WARN']
    """
    env = sys_info.env
    names = [k for k in ("GPUKIT_FAULT", "GPUKIT_FAULT_OOM_ABOVE") if env.get(k, "").strip()]
    if not names:
        return []
    shown = ", ".join(f"{k}={env[k]}" for k in names)
    return [
        Check(
            "fault injection",
            "WARN",
            f"{shown}: gpukit makes runs fail on purpose (crashes, hangs, out of memory)",
            f"unset {' and '.join(names)} unless you are rehearsing failures",
        )
    ]
