"""How much a model computes, and how much of a GPU's peak a run uses (MFU).

>>> from torch import nn
>>> forward_flops(nn.Linear(3, 2), torch.zeros(1, 3))
12.0
>>> mfu(494.5e12, "NVIDIA H100 80GB HBM3", gpus=1)
0.5
"""

from __future__ import annotations

import math

import torch
from torch import nn

# Dense bf16/fp16 tensor-core peaks (FLOP/s) of common GPUs, for MFU. A GPU takes the first
# entry its name contains, so longer names come before their prefixes (A10G before A10).
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


__all__ = ["PEAK_FLOPS", "forward_flops", "mfu"]
