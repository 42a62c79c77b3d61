"""Tiny `transformers` causal LMs built from a config (nothing downloaded), shared by the tests
of Hugging Face models under fsdp and of the planner's groups for them."""

from __future__ import annotations

from typing import Any


def tiny_config(kind: str, vocab: int, *, tied: bool = True) -> Any:
    """A 3-layer config: ``kind`` "gpt2" (its head always tied) or "llama" (tied or not)."""
    from transformers import AutoConfig

    if kind == "gpt2":
        return AutoConfig.for_model(
            "gpt2", vocab_size=vocab, n_positions=16, n_embd=16, n_layer=3, n_head=2
        )
    return AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
