"""What the fsdp tests share: a model with a tied embedding and head, and a bit-for-bit check."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 67  # does not divide by 2 or 4: the tied embedding's rows split unevenly


class TiedLM(nn.Module):
    """Embedding, residual Linear-ReLU-Linear blocks (fsdp shards each), and an output layer
    tied to the embedding."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and every tensor equal bit for bit (the worst differences shown)."""
    assert got.keys() == want.keys()
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    worst = {k: (got[k] - want[k]).abs().max().item() for k in unequal}
    assert not unequal, f"not bit-identical: {worst}"
