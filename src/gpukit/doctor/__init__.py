"""``gpukit doctor``: check every layer of the GPU stack, each with OK/WARN/FAIL and a fix.

>>> from gpukit.doctor import diagnose
>>> report = diagnose()
>>> report.ok          # True unless a check FAILs (a CPU-only machine is fine)
True
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from gpukit.devices import nvml as _nvml
from gpukit.devices.device import devices
from gpukit.doctor import checks, features, gpus
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
        *gpus.gpu_checks(t, nvml, env),
        *features.p2p_check(t),
        *features.precision_check(t),
        *features.order_check(t, nvml, env),
        *features.mps_check(sys_info, t),
        *features.environment_check(sys_info),
        *features.default_device_check(sys_info, t),
        *features.fault_injection_check(sys_info),
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
    """Every device with the same keys; None where a value does not apply."""
    extra = {"free_memory": None, "bf16": None, "test_allocation": None}
    rows = [{**d.to_dict(), **extra} for d in devices() if d.type != "cuda"]
    for g in t.gpus:
        rows.append(
            {
                "device": f"cuda:{g.index}",
                "type": "cuda",
                "index": g.index,
                "name": g.name,
                "total_memory": g.total_memory,
                "compute_capability": _capability(g.capability),
                "free_memory": g.free_memory,
                "bf16": g.bf16,
                "test_allocation": g.allocation,
            }
        )
    return rows


def _nvml_dict(nvml: _nvml.NvmlInfo) -> dict[str, Any]:
    cuda = nvml.cuda_driver_version  # (major, minor), printed like a capability
    return {
        "available": nvml.available,
        "error": nvml.error,
        "absence": nvml.absence,
        "driver_version": nvml.driver_version,
        "cuda_driver_version": _capability(cuda),
        "gpus": [
            {
                **{k: v for k, v in asdict(g).items() if k != "capability"},
                "compute_capability": _capability(g.capability),
            }
            for g in nvml.gpus
        ],
    }


def _capability(cc: tuple[int, int] | None) -> str | None:
    return f"{cc[0]}.{cc[1]}" if cc else None


__all__ = ["SCHEMA_VERSION", "Check", "DoctorReport", "Status", "diagnose", "evaluate"]
