"""The gpt2 workload: GPT-2 small's exact shape, its data (tokens of the bundled text, or
random), a few narrow layers for the CPU, and what it refuses; Llama 3.2 1B's sizes."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

from gpukit.cli.__main__ import main
from gpukit.errors import ConfigError
from gpukit.workloads import Workload, gpt2, load_workload, tokens
from gpukit.workloads.gpt import GPT, corpus
from gpukit.workloads.llama import llama3_2_1b

SMALL = {"n_layer": 2, "n_head": 2, "d_model": 32, "context": 16}


def test_the_default_shape_is_gpt2_small_as_nanogpt_trains_it() -> None:
    config = gpt2.GPT2_SMALL
    assert (config.n_layer, config.n_head, config.d_model, config.context) == (12, 12, 768, 1024)
    assert (config.vocab_size, config.dropout, config.bias) == (50304, 0.0, False)
    with torch.device("meta"):  # the shape alone: no memory, no time
        model = GPT(config)
    per_block = 2 * 768 + 768 * 3 * 768 + 768 * 768 + 2 * 768 * 4 * 768  # no biases
    expected = 50304 * 768 + 1024 * 768 + 12 * per_block + 768  # the head is tied: counted once
    assert sum(p.numel() for p in model.parameters()) == expected  # 124,373,760
    assert model.head.weight is model.token_embedding.weight
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_a_few_narrow_layers_train_a_step_on_the_cpu() -> None:
    workload = gpt2.build(seed=0, data="random", vocab_size=256, **SMALL)
    loader = torch.utils.data.DataLoader(workload.dataset, batch_size=4)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    loss = workload.loss(workload.model(x), y)
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - math.log(256)) < 0.5
    assert all(p.grad is not None for p in workload.model.parameters())
    assert workload.flops_per_sample > 0 and workload.batch_size == 12 and workload.lr == 6e-4


def test_the_seed_fixes_the_weights_and_the_data_does_not_depend_on_it() -> None:
    before = torch.get_rng_state()
    first, again, other = (gpt2.build(seed=s, vocab_size=256, **SMALL) for s in (1, 1, 2))
    assert torch.equal(torch.get_rng_state(), before)
    pairs = zip(first.model.parameters(), again.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    pairs = zip(first.model.parameters(), other.model.parameters(), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs)
    assert torch.equal(first.dataset[5][0], other.dataset[5][0])


def test_text_without_tiktoken_is_bytes_at_every_offset_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tokens, "find_spec", lambda name: None)
    workload = gpt2.build(**SMALL)
    text = corpus().encode()
    assert len(workload.dataset) == len(text) - 16  # every start: nanoGPT's random offsets
    x, y = workload.dataset[100]
    assert x.tolist() == list(text[100:116]) and y.tolist() == list(text[101:117])
    assert workload.data == "the bundled text as bytes (tiktoken is not installed)"
    held_out = corpus("heldout").encode()
    assert workload.validation is not None
    assert len(workload.validation) == (len(held_out) - 17) // 16 + 1  # windows apart
    assert workload.validation[1][0].tolist() == list(held_out[16:32])
    with pytest.raises(ConfigError, match="pip install tiktoken"):
        gpt2.build(tokenizer="gpt2", **SMALL)


class FakeEncoding:
    """Stands in for tiktoken's gpt2 encoding: one id per word, from 50,000 up."""

    def encode_ordinary(self, text: str) -> list[int]:
        return [50_000 + len(word) for word in text.split()]


def test_text_takes_gpt2_bpe_where_tiktoken_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("tiktoken")
    fake.get_encoding = lambda name: FakeEncoding()  # type: ignore[attr-defined]
    fake.__spec__ = types.SimpleNamespace(name="tiktoken")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setattr(tokens, "find_spec", lambda name: fake.__spec__)
    workload = gpt2.build(**SMALL)
    assert workload.data == "the bundled text as GPT-2 BPE tokens (tiktoken)"
    assert len(workload.dataset) == len(corpus().split()) - 16
    assert int(workload.dataset[0][0].min()) >= 50_000
    # GPT-2's ids do not fit a smaller vocabulary: said, not an index error mid-step.
    with pytest.raises(ConfigError, match="vocab_size=1000 is below the 50,257 ids"):
        gpt2.build(vocab_size=1000, **SMALL)


def test_a_tiktoken_that_cannot_load_its_encoding_falls_back_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def offline(name: str) -> None:
        raise ConnectionError("no network")

    fake = types.ModuleType("tiktoken")
    fake.get_encoding = offline  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tiktoken", fake)
    monkeypatch.setattr(tokens, "find_spec", lambda name: object())
    workload = gpt2.build(**SMALL)
    assert workload.data == (
        "the bundled text as bytes (tiktoken could not load it (ConnectionError: no network))"
    )
    with pytest.raises(ConfigError, match="ConnectionError: no network"):
        gpt2.build(tokenizer="gpt2", **SMALL)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": 2}, "GPTConfig has no field layers: its fields are vocab_size, context"),
        ({"n_layer": "2"}, "n_layer='2' must be an int >= 1"),
        ({"n_layer": 0}, "n_layer=0 must be an int >= 1"),
        ({"bias": 1}, "bias=1 must be True or False"),
        ({"dropout": -0.1}, "dropout=-0.1 must be a number >= 0"),
        ({"data": "words"}, "data='words' is not one of text, random"),
        ({"tokenizer": "bpe"}, "tokenizer='bpe' is not one of auto, gpt2, bytes"),
        ({"vocab_size": 100}, "vocab_size=100 is below the 256 ids of its bytes tokens"),
        ({"context": 10**6}, "too few for windows of context=1000000"),
    ],
)
def test_bad_sizes_and_data_say_what_is_allowed(kwargs: dict[str, object], message: str) -> None:
    sizes = {k: v for k, v in SMALL.items() if k not in kwargs}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gpt2.build(**{"tokenizer": "bytes", **sizes, **kwargs})  # type: ignore[arg-type]


def test_gpt2_is_a_builtin_by_name() -> None:
    # Full size: built once here, nothing run through it (124M parameters on the CPU).
    workload = load_workload("gpt2", seed=0)
    assert workload.name == "gpt2" and workload.model.config == gpt2.GPT2_SMALL
    assert workload.dataset[0][0].shape == (1024,)


def test_llama_1b_takes_sizes_for_a_few_narrow_layers() -> None:
    sizes = {"layers": 2, "dim": 64, "heads": 4, "kv_heads": 2, "hidden": 128, "vocab": 512}
    small = llama3_2_1b(seq_len=32, sizes=sizes)
    assert len(small.model.layers) == 2 and small.model.output.weight.shape == (512, 64)
    assert small.model.output.weight is small.model.tok_embeddings.weight  # 1B's tied head
    with pytest.raises(ConfigError, match="LlamaShape has no field n_layer"):
        llama3_2_1b(sizes={"n_layer": 2})
    # By name, as the planner loads it: load_workload's seed= is not taken for a size.
    assert load_workload("gpukit.workloads.llama:llama3_2_1b", meta=True).name == "llama3.2-1b"


def tiny_gpt2() -> Workload:
    """Loaded as "tests.workloads.test_gpt2:tiny_gpt2": gpt2's code at a size the CPU trains in
    a moment, on bytes (what a machine without tiktoken gets)."""
    return gpt2.build(n_layer=1, n_head=2, d_model=16, context=8, tokenizer="bytes")


def test_gpukit_train_says_what_the_tokens_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    args = ["train", "--workload", "tests.workloads.test_gpt2:tiny_gpt2", "--max-steps", "2"]
    assert main([*args, "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["workload"] == "gpt2" and metrics["data"] == "the bundled text as bytes"
    assert "gpt2 (the bundled text as bytes)" in capsys.readouterr().out
    assert (
        main(["train", "--workload", "mlp", "--max-steps", "1", "--out", str(tmp_path / "m")]) == 0
    )
    assert json.loads((tmp_path / "m" / "metrics.json").read_text())["data"] is None
