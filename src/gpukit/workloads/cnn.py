"""``cnn``: a small ResNet on synthetic 3x32x32 images of 10 classes.

Each class has its own smooth colour pattern; an image is its class pattern, shifted by up to
3 pixels, under pixel noise three times as strong as the pattern. The loss falls from 2.3 to
about 0.1 within two epochs; an epoch (32 steps of 64 images) takes a few seconds on a CPU.
The validation set holds 256 more images of the same class patterns, drawn from a generator of
its own (labels, shifts and noise): the training set is the same as without it.

>>> w = build(seed=0)
>>> x, y = w.dataset[0]
>>> x.shape, y.dtype, w.model(x[None]).shape, len(w.validation)
(torch.Size([3, 32, 32]), torch.int64, torch.Size([1, 10]), 256)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from gpukit.workloads.base import Workload
from gpukit.workloads.flops import forward_flops

SAMPLES = 2048
CLASSES = 10
SIZE = 32
WIDTHS = (16, 32, 64)  # channels per stage; each stage has 2 residual blocks
VALIDATION_SAMPLES = 256
_DATA_SEED = 20240602
_VALIDATION_SEED = 20240612  # held-out images: another stream over the same patterns
_MAX_SHIFT = 3  # pixels


def make_dataset(samples: int = SAMPLES, *, validation: bool = False) -> TensorDataset:
    """``samples`` images ``(x: float32[3, 32, 32], y: int64)``, the same on every call;
    ``validation`` True draws held-out images of the same patterns from another generator.

    >>> x, y = make_dataset(4).tensors
    >>> x.shape, bool(torch.equal(x, make_dataset(4).tensors[0]))
    (torch.Size([4, 3, 32, 32]), True)
    """
    gen = torch.Generator().manual_seed(_DATA_SEED)
    coarse = torch.randn(CLASSES, 3, 4, 4, generator=gen)
    patterns = F.interpolate(coarse, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
    patterns = patterns / patterns.std(dim=(1, 2, 3), keepdim=True)
    if validation:
        gen = torch.Generator().manual_seed(_VALIDATION_SEED)
    labels = torch.randint(0, CLASSES, (samples,), generator=gen)
    shifts = torch.randint(-_MAX_SHIFT, _MAX_SHIFT + 1, (samples, 2), generator=gen)
    images = torch.stack(
        [
            torch.roll(patterns[int(label)], shifts=(int(dy), int(dx)), dims=(1, 2))
            for label, (dy, dx) in zip(labels, shifts, strict=True)
        ]
    )
    images += 3.0 * torch.randn(images.shape, generator=gen)
    return TensorDataset(images, labels)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity (or 1x1 projection) shortcut, as in ResNet."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet-14: a 3x3 stem, three stages of two blocks, global pooling.

    >>> sum(p.numel() for p in ResNet().parameters())
    175258
    """

    def __init__(self, widths: tuple[int, ...] = WIDTHS, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        channels = widths[0]
        for stage, width in enumerate(widths):
            blocks.append(BasicBlock(channels, width, stride=1 if stage == 0 else 2))
            blocks.append(BasicBlock(width, width))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


def build(seed: int = 0) -> Workload:
    """The ``cnn`` workload, its weights drawn from ``seed`` (global RNG left untouched).

    ``flops_per_sample`` = 3 x the forward FLOPs of one image (convolutions and the final
    Linear, 2 per multiply-add; BatchNorm, ReLU and pooling are left out as negligible).

    >>> round(build().flops_per_sample / 1e6)
    160
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet()
    flops = 3 * forward_flops(model, torch.zeros(1, 3, SIZE, SIZE))
    return Workload(
        name="cnn",
        model=model,
        dataset=make_dataset(),
        loss=nn.CrossEntropyLoss(),
        batch_size=64,
        lr=2e-3,
        epochs=3,
        flops_per_sample=flops,
        validation=make_dataset(VALIDATION_SAMPLES, validation=True),
        accuracy=True,
    )
