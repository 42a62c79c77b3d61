"""Facts of a model of identical blocks, measured through a few of them, equal the facts
measured through all of them, field by field; blocks that differ are measured whole."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.planning import repeats
from gpukit.planning.facts import model_facts
from gpukit.workloads.llama import LlamaShape, llama

SMALL = LlamaShape(dim=64, layers=7, heads=4, kv_heads=2, hidden=128, vocab=256)


def _whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repeats, "repeated_blocks", lambda model: None)


def _calls(block: nn.Module) -> list[int]:
    seen: list[int] = []
    block.register_forward_pre_hook(lambda *_: seen.append(1))
    return seen


@pytest.mark.parametrize(
    ("precision", "checkpointing", "param_dtype"),
    [
        ("32", "off", None),
        ("32", "full", torch.bfloat16),
        ("bf16-mixed", "selective", None),
        ("bf16-mixed", "off", torch.bfloat16),
    ],
)
def test_meta_llama_facts_equal_either_way(
    monkeypatch: pytest.MonkeyPatch, precision: str, checkpointing: str, param_dtype: Any
) -> None:
    w = llama(SMALL, seq_len=32, batch_size=2)
    last = _calls(w.model.layers[-1])
    kwargs: dict[str, Any] = {
        "precision": precision,
        "activation_checkpointing": checkpointing,
        "loss": w.loss,
        "param_dtype": param_dtype,
    }
    fast = model_facts(w.model, w.dataset[0], **kwargs)
    assert last == []  # measured through the first blocks only
    with monkeypatch.context() as m:
        _whole(m)
        slow = model_facts(w.model, w.dataset[0], **kwargs)
    assert last == [1, 1]
    assert fast == slow
    assert len(w.model.layers) == SMALL.layers  # the model is as it was


class _Block(nn.Module):
    def __init__(self, width: int, layer_idx: int = 0) -> None:
        super().__init__()
        self.fc, self.layer_idx = nn.Linear(width, width), layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x).relu()
        return y.sigmoid() if self.layer_idx % 2 else y


class _Net(nn.Module):
    def __init__(self, widths: list[int], by_index: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(w, i) for i, w in enumerate(widths))
        self.by_index = by_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.by_index:  # reads blocks by position: fails when truncated
            for i in range(6):
                x = self.layers[i](x)
            return x
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize(
    ("net", "shortened"),
    [
        (_Net([8] * 6), False),  # every other block also saves a sigmoid: middles differ
        (_Net([8, 8, 8, 8, 8, 8], by_index=True), False),
        (nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]), True),
    ],
)
def test_blocks_that_differ_are_measured_whole(
    monkeypatch: pytest.MonkeyPatch, net: nn.Module, shortened: bool
) -> None:
    blocks = list(net.layers if isinstance(net, _Net) else net)
    last = _calls(blocks[-1])
    example = (torch.ones(8), torch.ones(8))
    fast = model_facts(net, example)
    assert (last == []) is shortened
    with monkeypatch.context() as m:
        _whole(m)
        assert model_facts(net, example) == fast


def test_blocks_of_other_shapes_are_not_repeated() -> None:
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)], nn.Linear(8, 4))
    assert repeats.repeated_blocks(net) is None
    assert repeats.repeated_blocks(nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)]))


def test_stretch_lays_out_every_block() -> None:
    # (block, entered, size): before, 4 measured blocks with a gap after each, after.
    parts = [(-1, 0, 1)]
    for b in range(repeats.MEASURED):
        parts += [(b, b + 1, 10 + (b == 0)), (-1, b + 1, 5)]
    laid = repeats.stretch(parts, lambda s: s[0], lambda s: s[1], lambda s: s[2], total=6)
    assert laid is not None
    blocks = [b for _, b in laid]
    assert [k for k, _ in itertools.groupby(b for b in blocks if b >= 0)] == list(range(6))
    assert sum(s[2] for s, _ in laid) == 1 + 11 + 10 * 5 + 5 * 6


def test_facts_do_not_depend_on_which_storage_ids_were_free() -> None:
    # Storages noted (a kept operation's output, a block's input) are held while measuring,
    # so a storage made later cannot take a freed one's id and be counted as it.
    from gpukit.workloads.base import load_workload

    w = load_workload("gpt")
    kwargs: dict[str, Any] = {"loss": w.loss, "precision": "bf16-mixed"}
    for mode in ("selective", "full"):
        runs = [
            model_facts(w.model, w.dataset[0], activation_checkpointing=mode, **kwargs)
            for _ in range(3)
        ]
        assert runs[0] == runs[1] == runs[2]
