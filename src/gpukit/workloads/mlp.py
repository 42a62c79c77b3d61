"""``mlp``: a tiny multilayer perceptron on synthetic, learnable classification data.

Each of 4 classes is a Gaussian cloud around its own centre in 32 dimensions; the clouds
overlap a little, so accuracy climbs over a few epochs instead of being perfect at once.
An epoch (2048 samples) takes a few milliseconds on a CPU. The validation set holds 512 more
points of the same clouds, drawn from a generator of its own: none of them is a training point,
and the training set is the same as without it.

>>> w = build(seed=0)
>>> len(w.dataset), w.dataset[0][0].shape, w.batch_size, len(w.validation)
(2048, torch.Size([32]), 64, 512)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpukit.workloads.base import Workload
from gpukit.workloads.flops import forward_flops

SAMPLES = 2048
FEATURES = 32
CLASSES = 4
HIDDEN = 64
VALIDATION_SAMPLES = 512
_DATA_SEED = 20240601  # the data is the same for every model seed: runs differ only in init
_VALIDATION_SEED = 20240611  # held-out points: another stream around the same centres


def make_dataset(samples: int = SAMPLES, *, validation: bool = False) -> TensorDataset:
    """``samples`` points ``(x: float32[32], y: int64)``, the same on every call;
    ``validation`` True draws held-out points around the same centres from another generator.

    >>> x, y = make_dataset(8).tensors
    >>> x.shape, y.tolist() == make_dataset(8).tensors[1].tolist()
    (torch.Size([8, 32]), True)
    >>> bool(torch.equal(make_dataset(8, validation=True).tensors[0], x))
    False
    """
    gen = torch.Generator().manual_seed(_DATA_SEED)
    # Centres about 2.5 apart against unit noise: separable enough to learn, not trivially.
    centres = torch.randn(CLASSES, FEATURES, generator=gen) * 0.45
    if validation:
        gen = torch.Generator().manual_seed(_VALIDATION_SEED)
    labels = torch.randint(0, CLASSES, (samples,), generator=gen)
    points = centres[labels] + torch.randn(samples, FEATURES, generator=gen)
    return TensorDataset(points, labels)


def make_model() -> nn.Sequential:
    """32 -> 64 -> 64 -> 4, ReLU between; initialised from the global RNG."""
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def build(seed: int = 0) -> Workload:
    """The ``mlp`` workload, its weights drawn from ``seed`` (global RNG left untouched).

    ``flops_per_sample`` = 3 x the forward FLOPs (2 per multiply-add of each Linear).

    >>> build().flops_per_sample == 3 * 2 * (32 * 64 + 64 * 64 + 64 * 4)
    True
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model()
    flops = 3 * forward_flops(model, torch.zeros(1, FEATURES))
    return Workload(
        name="mlp",
        model=model,
        dataset=make_dataset(),
        loss=nn.CrossEntropyLoss(),
        batch_size=64,
        lr=3e-3,
        epochs=10,
        flops_per_sample=flops,
        validation=make_dataset(VALIDATION_SAMPLES, validation=True),
        accuracy=True,
    )
