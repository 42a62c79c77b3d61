"""How much a model computes, and how much of a GPU's peak a run uses (MFU), with the dense
peak of known GPUs per dtype.

>>> from torch import nn
>>> forward_flops(nn.Linear(3, 2), torch.zeros(1, 3))
12.0
>>> mfu(494.5e12, "NVIDIA H100 80GB HBM3", gpus=1)
0.5
>>> peak_flops("NVIDIA A100-SXM4-80GB", "tf32")
156000000000000.0
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gpukit.errors import ConfigError

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of common GPUs, rounded, for MFU. A GPU takes the
# first entry its name contains, so longer names come before their prefixes (A10G before A10).
# DENSE_PEAK_FLOPS below has every dtype and more variants, for the matmul benchmark.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "A10": 125e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "T4": 65e12,
}


# Dense peaks (FLOP/s, no 2:4 sparsity) per dtype, from NVIDIA's datasheets and architecture
# whitepapers: fp32 on the CUDA cores; tf32, bf16 and fp16 on the tensor cores, fp16 with fp32
# accumulation (what torch asks cuBLAS for). A GPU takes the first entry its name contains, so
# longer names come before their prefixes ("H100 PCIe" before "H100", "L40S" and "L40" before
# "L4", "A100" and "A10G" before "A10"). A dtype missing from an entry has no tensor-core path
# on that GPU (no tf32 or bf16 before Ampere). The A10G has the A10's figures (NVIDIA
# publishes none of its own); a variant missing here takes its family's entry, of the same
# or higher clocks (H100 NVL: H100, H200 NVL: H200), so a share of that peak errs low. A
# GeForce card that boosts past its published clock can measure a little over 100%.
DENSE_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H100 PCIe": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "L40": {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "A10G": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "V100S": {"fp32": 16.4e12, "fp16": 130e12},
    "V100-PCIE": {"fp32": 14e12, "fp16": 112e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12},
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
    "RTX 3090": {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}

# The dtype names peak_flops takes, and the torch dtypes that stand for them (tf32 is a way of
# multiplying float32 tensors, not a dtype of its own).
PEAK_DTYPES = ("fp32", "tf32", "bf16", "fp16")
_TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def peak_flops(device_name: str, dtype: str | torch.dtype) -> float | None:
    """The dense peak FLOP/s of the GPU called ``device_name`` for ``dtype`` (``"fp32"``,
    ``"tf32"``, ``"bf16"``, ``"fp16"`` or the torch dtype), from :data:`DENSE_PEAK_FLOPS`;
    None for a GPU not in the table (and for any CPU) or a dtype it has no peak for.

    >>> peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) / 1e12
    989.4
    >>> peak_flops("NVIDIA L4", "fp32") / 1e12, peak_flops("Tesla T4", "bf16")
    (30.3, None)
    >>> peak_flops("NVIDIA H100 80GB HBM3", "int8")
    Traceback (most recent call last):
    ...
    gpukit.errors.ConfigError: dtype 'int8': peaks are known for fp32, tf32, bf16, fp16 ...
    """
    name = _TORCH_DTYPES.get(dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in PEAK_DTYPES:
        torch_names = ", ".join(str(d) for d in _TORCH_DTYPES)
        raise ConfigError(
            f"dtype {str(dtype)!r}: peaks are known for {', '.join(PEAK_DTYPES)} (or {torch_names})"
        )
    peaks = next((v for k, v in DENSE_PEAK_FLOPS.items() if k in device_name), None)
    return peaks.get(name) if peaks is not None else None


def forward_flops(model: nn.Module, example: torch.Tensor) -> float:
    """FLOPs of one forward pass of ``model`` on ``example``, counting its ``Linear`` and
    ``Conv*d`` layers at 2 per multiply-add (norms, activations and pooling are negligible
    next to them and left out; matmuls outside such layers are not seen).

    Runs in eval mode under ``no_grad`` so BatchNorm statistics stay untouched, then restores
    the model's mode. Counted with hooks rather than ``torch.utils.flop_counter``, whose first
    use costs over a second of imports.

    >>> forward_flops(nn.Conv2d(2, 4, 3), torch.zeros(1, 2, 5, 5))  # 2 * (2*3*3) * (4*3*3)
    1296.0
    """
    total = 0

    def count(layer: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(layer, nn.Linear):
            total += 2 * layer.in_features * output.numel()
        elif isinstance(layer, nn.modules.conv._ConvNd):
            per_output = layer.in_channels // layer.groups * math.prod(layer.kernel_size)
            total += 2 * per_output * output.numel()

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(example)
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return float(total)


def mfu(flops_per_s: float, device_name: str, gpus: int) -> float | None:
    """Model FLOPs utilisation: ``flops_per_s`` (the training FLOP/s achieved over all GPUs)
    as a fraction of the dense bf16 peak of ``gpus`` GPUs called ``device_name`` (see
    :data:`PEAK_FLOPS`). None when nothing was counted or the GPU's peak is unknown.

    >>> mfu(989e12, "NVIDIA H100 80GB HBM3", gpus=2)
    0.5
    >>> mfu(1e12, "NVIDIA GeForce GTX 1080", gpus=1) is None
    True
    """
    if not flops_per_s:
        return None
    peak = next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)
    return flops_per_s / (peak * gpus) if peak else None


__all__ = ["DENSE_PEAK_FLOPS", "PEAK_DTYPES", "PEAK_FLOPS", "forward_flops", "mfu", "peak_flops"]
