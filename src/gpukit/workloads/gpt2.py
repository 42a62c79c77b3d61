"""``gpt2``: GPT-2 small as nanoGPT configures and trains it, at full size by default.

The model is the ``gpt`` workload's :class:`~gpukit.workloads.gpt.GPT` with nanoGPT's GPT-2
settings: 12 layers of 12 heads, width 768, a context of 1,024 tokens, a vocabulary of 50,304
(GPT-2's 50,257 padded to a multiple of 64, as nanoGPT pads it), no biases in the linear layers
and LayerNorms, no dropout, the output layer tied to the token embedding and attention through
``scaled_dot_product_attention`` (flash attention on a GPU): 124M parameters, initialised as
GPT-2 is (normal with standard deviation 0.02, the residual projections scaled down by
``sqrt(2 * n_layer)``).

Its data, by ``data``:

- ``"text"`` (default): the bundled text as tokens, every offset a window (nanoGPT draws random
  offsets; a shuffled loader draws them without repeating one), validated on the held-out text
  cut into windows that do not overlap. GPT-2's BPE (tiktoken) where it loads, else bytes:
  :attr:`~gpukit.workloads.base.Workload.data` says which, and why.
- ``"random"``: random tokens (sequence ``i`` from seed ``i``), for runs that measure speed.

Training: a global batch of 12 sequences at a learning rate of 6e-4 (nanoGPT's per-GPU batch and
peak rate for GPT-2). ``sizes`` change fields of :class:`~gpukit.workloads.gpt.GPTConfig`, so that
a test on the CPU builds a few narrow layers:

>>> w = build(n_layer=2, n_head=2, d_model=32, context=16, vocab_size=512, data="random")
>>> x, y = w.dataset[0]
>>> w.name, x.shape, len(w.model.blocks), w.data
('gpt2', torch.Size([16]), 2, 'random tokens below 512')
>>> with torch.device("meta"):  # the full size's shape, without memory
...     print(f"{sum(p.numel() for p in GPT(GPT2_SMALL).parameters()):,}")
124,373,760
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from gpukit.errors import ConfigError
from gpukit.workloads.base import Workload, replaced
from gpukit.workloads.gpt import GPT, GPTConfig, SequenceCrossEntropy, corpus, flops_per_sample
from gpukit.workloads.tokens import GPT2_VOCAB, RandomTokens, Tokenizer, TokenWindows, encode

GPT2_SMALL = GPTConfig(
    vocab_size=50304, context=1024, n_layer=12, n_head=12, d_model=768, dropout=0.0, bias=False
)
BATCH_SIZE = 12  # sequences per optimizer step (nanoGPT: 12 per GPU, accumulated 40 times)
LR = 6e-4
RANDOM_SEQUENCES = 4096  # sequences of random tokens: an epoch longer than any speed run
DATA = ("text", "random")


def build(
    seed: int = 0,
    *,
    data: Literal["text", "random"] = "text",
    tokenizer: Tokenizer = "auto",
    **sizes: Any,
) -> Workload:
    """The ``gpt2`` workload (see the module doc), its weights drawn from ``seed`` (the global
    random state left as it was); ``tokenizer`` for ``data="text"``: ``"auto"``, ``"gpt2"`` or
    ``"bytes"`` (:func:`~gpukit.workloads.tokens.encode`)."""
    if data not in DATA:
        raise ConfigError(f"gpt2: data={data!r} is not one of {', '.join(DATA)}")
    config = replaced(GPT2_SMALL, sizes)
    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]]
    if data == "text":
        tokens, used, why = encode(corpus(), tokenizer)
        held_out, _, _ = encode(corpus("heldout"), "gpt2" if used == "gpt2" else "bytes")
        needed = GPT2_VOCAB if used == "gpt2" else 256
        if config.vocab_size < needed:
            raise ConfigError(
                f"gpt2: vocab_size={config.vocab_size} is below the {needed:,} ids of its "
                f"{used} tokens: raise vocab_size, or use data='random'"
            )
        dataset = TokenWindows(tokens, config.context, stride=1)
        validation = TokenWindows(held_out, config.context, stride=config.context)
        named = "GPT-2 BPE tokens (tiktoken)" if used == "gpt2" else "bytes"
        description = f"the bundled text as {named}" + (f" ({why})" if why else "")
    else:
        dataset = RandomTokens(config.context, RANDOM_SEQUENCES, config.vocab_size)
        validation = None
        description = f"random tokens below {config.vocab_size}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return Workload(
        name="gpt2",
        model=model,
        dataset=dataset,
        loss=SequenceCrossEntropy(),
        batch_size=BATCH_SIZE,
        lr=LR,
        epochs=1,
        flops_per_sample=flops_per_sample(model),
        validation=validation,
        data=description,
    )
