"""``gpukit doctor``: check every layer of the GPU stack, each with OK/WARN/FAIL and a fix.

>>> from gpukit.doctor import diagnose
>>> report = diagnose()
>>> report.ok          # True unless a check FAILs (a CPU-only machine is fine)
True
"""

from __future__ import annotations

from typing import Any

import torch

from gpukit import _nvml
from gpukit.devices import devices
from gpukit.doctor import checks, features
from gpukit.doctor.probe import SystemInfo, TorchInfo, read_system, read_torch
from gpukit.doctor.report import SCHEMA_VERSION, Check, DoctorReport, Status


def diagnose(test_allocation: bool = True) -> DoctorReport:
    """Read this machine and run every check."""
    return evaluate(read_system(), read_torch(test_allocation), _nvml.read())


def evaluate(sys_info: SystemInfo, t: TorchInfo, nvml: _nvml.NvmlInfo) -> DoctorReport:
    """Run every check on facts already read (the seam tests use to play other machines)."""
    env = sys_info.env
    found: list[Check] = [
        *checks.system_checks(sys_info, torch.get_num_threads()),
        *checks.torch_checks(t, len(t.gpus)),
        checks.driver_check(t, nvml),
        *checks.gpu_checks(t, nvml, env),
        *features.p2p_check(t),
        *features.precision_check(t),
        *features.order_check(nvml, env),
        *features.mps_check(sys_info, t),
        *features.environment_check(sys_info),
    ]
    return DoctorReport(
        checks=tuple(found),
        devices=tuple(_device_rows(t)),
        nvml=_nvml_dict(nvml),
        p2p=(
            {"devices": [f"cuda:{g.index}" for g in t.gpus], "matrix": [list(row) for row in t.p2p]}
            if t.p2p
            else None
        ),
    )


def _device_rows(t: TorchInfo) -> list[dict[str, Any]]:
    rows = [devices()[0].to_dict()]  # the CPU
    for g in t.gpus:
        rows.append(
            {
                "device": f"cuda:{g.index}",
                "type": "cuda",
                "index": g.index,
                "name": g.name,
                "total_memory": g.total_memory,
                "compute_capability": f"{g.capability[0]}.{g.capability[1]}",
                "free_memory": g.free_memory,
                "bf16": g.bf16,
                "test_allocation": "ok" if g.alloc_error is None else g.alloc_error,
            }
        )
    return rows


def _nvml_dict(nvml: _nvml.NvmlInfo) -> dict[str, Any]:
    cuda = nvml.cuda_driver_version
    return {
        "available": nvml.available,
        "error": nvml.error,
        "driver_version": nvml.driver_version,
        "cuda_driver_version": f"{cuda[0]}.{cuda[1]}" if cuda else None,
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "memory_total": g.memory_total,
                "memory_used": g.memory_used,
                "memory_free": g.memory_free,
                "utilization": g.utilization,
                "compute_capability": f"{g.capability[0]}.{g.capability[1]}"
                if g.capability
                else None,
            }
            for g in nvml.gpus
        ],
    }


__all__ = ["SCHEMA_VERSION", "Check", "DoctorReport", "Status", "diagnose", "evaluate"]
