"""The planner's facts for a model that names its blocks in ``_no_split_modules`` (Hugging
Face ``transformers`` models built from a config, no download; an encoder-decoder of plain
modules) use the groups fsdp shards it into: largest block, the root's bytes, the number of
blocks, and under activation checkpointing the blocks fsdp recomputes."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.planning.facts import model_facts, recomputed_blocks
from tests.hf_models import tiny_config

VOCAB, CONTEXT = 64, 8


def _hf_model(kind: str) -> nn.Module:
    pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install gpukit[hf])"
    )
    from transformers import AutoModelForCausalLM

    config = tiny_config("gpt2" if kind == "gpt2" else "llama", VOCAB, tied=kind == "llama-tied")
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Encoder(_Block):
    pass


class _Decoder(_Block):
    pass


class _EncoderDecoder(nn.Module):
    """Two lists of blocks of two classes, both named in ``_no_split_modules`` (as T5 names
    its blocks): fsdp groups every one, not only the larger list's."""

    _no_split_modules: ClassVar[list[str]] = ["_Encoder", "_Decoder"]

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([_Encoder(8) for _ in range(2)])
        self.decoder = nn.ModuleList([_Decoder(8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder, *self.decoder]:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied"])
def test_facts_of_a_transformers_model_use_the_groups_fsdp_shards(kind: str) -> None:
    ids = torch.arange(CONTEXT) % VOCAB
    _check_against_fsdp(_hf_model(kind), (ids, ids), blocks=3)


def test_facts_recompute_every_declared_block_as_fsdp_does() -> None:
    torch.manual_seed(0)
    _check_against_fsdp(_EncoderDecoder(), (torch.ones(8), torch.tensor(0)), blocks=5)


def _check_against_fsdp(model: nn.Module, example: tuple[torch.Tensor, ...], blocks: int) -> None:
    facts = model_facts(model, example, activation_checkpointing="full")
    recomputed = recomputed_blocks(model)

    rt = gk.Runtime(strategy=gk.strategies.FSDP(activation_checkpointing="full"), devices="cpu")
    try:
        rt.setup(model)
        plan = rt.strategy.plans[-1]
        *groups, root = plan.groups
        assert root.name.startswith("(root")
        assert facts.block_groups == len(groups) == blocks
        assert facts.largest_block_bytes == max(g.full_bytes for g in groups)
        assert facts.root_group_bytes == root.full_bytes
        assert facts.largest_group_bytes == max(g.full_bytes for g in plan.groups)
        assert "_no_split_modules" in plan.note
        # The modules the facts count as recomputed are those fsdp made recompute.
        recomputing = [
            m for m in rt.unwrap(model).modules() if getattr(m, "_gpukit_recomputes", None)
        ]
        assert [id(m) for m in recomputed] == [id(m) for m in recomputing]
    finally:
        rt.teardown()
