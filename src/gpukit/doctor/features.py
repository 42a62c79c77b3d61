"""Checks of what the GPUs can do together and what the environment changes: peer-to-peer
access, bf16/TF32, GPU numbering, MPS on macOS, and CUDA/NCCL variables."""

from __future__ import annotations

from gpukit.devices.nvml import NvmlInfo
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
