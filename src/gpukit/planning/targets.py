"""What a plan is for: the device's memory, its peak FLOP/s per dtype, the link between
devices of one machine, and what a GPU holds beside tensors (the CUDA context, the allocator's
reserve).

A plan can be made for this machine (``target(None)``: its first GPU, read through
:mod:`gpukit.devices.hw`, or its CPU) or for a GPU it does not have (``target("h100")``), so
that "will it fit on an A100 40GB?" has an answer on a laptop. Figures that are not measured
are documented constants; :mod:`gpukit.planning.calibrate` replaces them with measurements.

>>> t = target("h100")
>>> t.name, t.kind, t.memory_bytes // 2**20, t.link_bytes_per_s / 1e9
('H100', 'cuda', 81559, 450.0)
>>> with_memory(t, parse_bytes("40GiB")).memory_bytes == 40 * 2**30
True
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Literal

from gpukit.devices import hw
from gpukit.errors import ConfigError
from gpukit.workloads.flops import PEAK_DTYPES, peak_flops

MiB = 2**20
GB = 10**9

# What the CUDA driver holds per process before any tensor (the context: kernels of torch,
# cuBLAS and cuDNN loaded, per-thread stacks): 300-500 MiB on current GPUs and drivers with
# lazy module loading (torch's default since CUDA 11.7), more without. The high end, so that a
# plan errs on the side of not fitting; calibrate() measures it.
CUDA_CONTEXT_BYTES = 500 * MiB
# The caching allocator keeps freed blocks for reuse and rounds requests up, so what it
# reserves exceeds what tensors hold; a few percent in a steady training loop. calibrate()
# measures it as (max reserved - max allocated) / max allocated.
ALLOCATOR_RESERVE_FRACTION = 0.05

# Bytes/s one way between two devices of one machine, what NCCL reaches in practice: NVLink
# from NVIDIA's datasheets (H100/H200 SXM: 900 GB/s both ways together, 450 one way; A100
# SXM: 600, 300; V100 SXM2: 300, 150), PCIe as measured by copy benchmarks (Gen4 x16: 32 GB/s
# in theory, ~25 in practice; Gen5 ~50; Gen3 ~12).
NVLINK4 = 450e9
NVLINK3 = 300e9
NVLINK2 = 150e9
PCIE5 = 50e9
PCIE4 = 25e9
PCIE3 = 12e9
# Seconds per hop of a collective (what a small message costs): a few microseconds over
# NVLink and PCIe for NCCL; tens over loopback TCP for gloo between CPU processes.
NVLINK_LATENCY_S = 5e-6
PCIE_LATENCY_S = 10e-6
CPU_LATENCY_S = 50e-6
# Two processes on one CPU exchange tensors through loopback TCP (gloo): memory-copy bound.
CPU_LINK_BYTES_PER_S = 5e9
# A CPU has no datasheet figure gpukit reads; one core with AVX2 does 2 fused multiply-adds on
# 8 float32 lanes per cycle: 32 FLOP/cycle, ~64e9 FLOP/s at a sustained 2 GHz.
CPU_FP32_FLOPS_PER_CORE = 64e9


@dataclass(frozen=True)
class _Gpu:
    family: str  # as flops.DENSE_PEAK_FLOPS names it
    variants: tuple[tuple[str, int], ...]  # (memory tag, bytes): the first is the default
    link: float
    latency: float
    pcie_link: float  # the same GPU on a PCIe card (no NVLink bridge)


def _mib(n: int) -> int:
    return n * MiB


# Memory of known GPUs. NVIDIA names the size in round "GB" (the tag); torch's total_memory
# and nvidia-smi report it in MiB, which is what a plan compares with: the MiB figures are those
# nvidia-smi prints for the SXM or PCIe board of that size (torch's total_memory is the same
# to within a few MiB). "80GB" is 81559 MiB on an H100 (85.5e9 bytes, 79.6 GiB) but 81920 MiB
# on an A100. A family looked up without a size takes its first (largest) variant. Families
# whose name is a prefix of another's come after it (H100 PCIe, L40S, L40, L4; A100, A10G, A10).
GPUS: tuple[_Gpu, ...] = (
    _Gpu("H200", (("141GB", _mib(143771)),), NVLINK4, NVLINK_LATENCY_S, PCIE5),
    _Gpu("H100 PCIe", (("80GB", _mib(81559)),), PCIE5, PCIE_LATENCY_S, PCIE5),
    _Gpu("H100", (("80GB", _mib(81559)),), NVLINK4, NVLINK_LATENCY_S, PCIE5),
    _Gpu("A100", (("80GB", _mib(81920)), ("40GB", _mib(40960))), NVLINK3, NVLINK_LATENCY_S, PCIE4),
    _Gpu("L40S", (("48GB", _mib(46068)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("L40", (("48GB", _mib(46068)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("L4", (("24GB", _mib(23034)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("A10G", (("24GB", _mib(23028)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("A10", (("24GB", _mib(23028)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("V100", (("32GB", _mib(32510)), ("16GB", _mib(16160))), NVLINK2, NVLINK_LATENCY_S, PCIE3),
    _Gpu("RTX 4090", (("24GB", _mib(24564)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("RTX 3090", (("24GB", _mib(24576)),), PCIE4, PCIE_LATENCY_S, PCIE4),
    _Gpu("T4", (("16GB", _mib(15360)),), PCIE3, PCIE_LATENCY_S, PCIE3),
)


@dataclass(frozen=True)
class Target:
    """A device to plan for (see the module doc). ``memory_bytes`` None: unknown;
    ``peak_flops`` maps "fp32"/"tf32"/"bf16"/"fp16" to dense FLOP/s (a CPU's "fp32" is an
    estimate, see :data:`CPU_FP32_FLOPS_PER_CORE`)."""

    name: str
    kind: Literal["cuda", "cpu"]
    memory_bytes: int | None
    peak_flops: dict[str, float]
    link_bytes_per_s: float
    link_latency_s: float
    cuda_context_bytes: int
    allocator_reserve_fraction: float


def target(spec: str | None = None) -> Target:
    """The target ``spec`` names: None for this machine (its first CUDA device, else its CPU),
    ``"cpu"``, or a GPU name, case-insensitive, spaces and dashes optional, a size picking the
    variant (``"h100"``, ``"NVIDIA A100-SXM4-40GB"``, ``"a100-40gb"``, ``"v100 16gb"``).

    >>> target("a100-40gb").memory_bytes // 2**20, target("A100").memory_bytes // 2**20
    (40960, 81920)
    >>> target("tpu")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: unknown target 'tpu': use 'cpu', a GPU among H200, ...
    """
    if spec is None:
        return _this_machine()
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"target {spec!r}: give a GPU name such as 'h100', or 'cpu'")
    if _normal(spec) == "CPU":
        return _cpu()
    key = _normal(spec)
    gpu = next((g for g in GPUS if _normal(g.family) in key), None)
    if gpu is None:
        raise ConfigError(
            f"unknown target {spec!r}: use 'cpu', a GPU among {', '.join(known_names())}, "
            "or None for this machine's first GPU"
        )
    tag, memory = next(((t, m) for t, m in gpu.variants if _normal(t) in key), gpu.variants[0])
    name = gpu.family if len(gpu.variants) == 1 else f"{gpu.family} {tag}"
    return _gpu_target(name, gpu, memory, pcie="PCIE" in key)


def known_names() -> list[str]:
    """Every GPU :func:`target` knows, with its sizes.

    >>> known_names()[:4]
    ['H200', 'H100 PCIe', 'H100', 'A100 80GB']
    """
    return [
        g.family if len(g.variants) == 1 else f"{g.family} {tag}"
        for g in GPUS
        for tag, _ in g.variants
    ]


def with_memory(t: Target, memory_bytes: int) -> Target:
    """``t`` with ``memory_bytes`` of memory (a smaller share of a GPU, a MIG slice).

    >>> with_memory(target("l4"), 10**9).memory_bytes
    1000000000
    """
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes <= 0:
        raise ConfigError(
            f"memory_bytes={memory_bytes!r}: give a whole number of bytes above 0 "
            "(parse_bytes('24GB') reads a size)"
        )
    return dataclasses.replace(t, memory_bytes=memory_bytes)


_UNIT_BYTES = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 2**10,
    "M": 2**20,
    "G": 2**30,
    "T": 2**40,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_bytes(text: str) -> int:
    """Bytes in ``text``: ``"80GiB"``, ``"24GB"`` (10^9), ``"512MiB"``, ``"1.5G"`` (binary,
    as torch and ``ulimit`` read a bare letter), or a plain number of bytes.

    >>> parse_bytes("24GB"), parse_bytes("512MiB"), parse_bytes("1024")
    (24000000000, 536870912, 1024)
    >>> parse_bytes("lots")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: size 'lots': give a number above 0 with a unit ...
    """
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNIT_BYTES.get(m.group(2).upper()) if m else None
    value = float(m.group(1)) * unit if m and unit is not None else 0.0
    if not 1 <= value < 2**63:  # also refuses inf and nan
        raise ConfigError(
            f"size {text!r}: give a number above 0 with a unit such as '80GiB', '24GB' or "
            "'512MiB' (B, KB, MB, GB, TB are powers of 10; KiB, MiB, GiB, TiB of 2)"
        )
    return int(value)


def _normal(text: str) -> str:
    return re.sub(r"[\s_\-]", "", text).upper()


def _peaks(name: str) -> dict[str, float]:
    return {d: v for d in PEAK_DTYPES if (v := peak_flops(name, d)) is not None}


def _gpu_target(name: str, gpu: _Gpu, memory: int | None, *, pcie: bool) -> Target:
    return Target(
        name=name,
        kind="cuda",
        memory_bytes=memory,
        peak_flops=_peaks(gpu.family),
        link_bytes_per_s=gpu.pcie_link if pcie else gpu.link,
        link_latency_s=PCIE_LATENCY_S if pcie else gpu.latency,
        cuda_context_bytes=CUDA_CONTEXT_BYTES,
        allocator_reserve_fraction=ALLOCATOR_RESERVE_FRACTION,
    )


def _cpu() -> Target:
    cores = hw.cpu_cores()[1]
    return Target(
        name=hw.cpu_name(),
        kind="cpu",
        memory_bytes=hw.ram_total(),
        peak_flops={"fp32": cores * CPU_FP32_FLOPS_PER_CORE},
        link_bytes_per_s=CPU_LINK_BYTES_PER_S,
        link_latency_s=CPU_LATENCY_S,
        cuda_context_bytes=0,
        allocator_reserve_fraction=0.0,
    )


def _this_machine() -> Target:
    if not hw.cuda_count():
        return _cpu()
    props = hw.cuda_properties(0)
    key = _normal(props.name)
    gpu = next((g for g in GPUS if _normal(g.family) in key), None)
    if gpu is None:  # a GPU not in the table: its memory is known, its peak and links are not
        return Target(
            name=props.name,
            kind="cuda",
            memory_bytes=props.total_memory,
            peak_flops=_peaks(props.name),
            link_bytes_per_s=PCIE4,
            link_latency_s=PCIE_LATENCY_S,
            cuda_context_bytes=CUDA_CONTEXT_BYTES,
            allocator_reserve_fraction=ALLOCATOR_RESERVE_FRACTION,
        )
    found = _gpu_target(props.name, gpu, props.total_memory, pcie="PCIE" in key)
    # The device's own name finds its exact peaks (V100-PCIE, V100S) where the table has them.
    return dataclasses.replace(found, peak_flops=_peaks(props.name) or found.peak_flops)


__all__ = [
    "ALLOCATOR_RESERVE_FRACTION",
    "CUDA_CONTEXT_BYTES",
    "GPUS",
    "Target",
    "known_names",
    "parse_bytes",
    "target",
    "with_memory",
]
