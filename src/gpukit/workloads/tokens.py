"""Token data for the language-model workloads: text as token ids, cut into training windows,
and random tokens for runs that measure speed alone.

Text is tokenized with GPT-2's BPE (``tiktoken``'s ``gpt2`` encoding, as nanoGPT prepares its
data) where ``tiktoken`` is installed and its encoding loads (it is downloaded once, then read
from tiktoken's cache); otherwise each UTF-8 byte is a token, and :func:`encode` says why.

>>> ids, tokenizer, why = encode("hello", tokenizer="bytes")
>>> ids.tolist(), tokenizer, why
([104, 101, 108, 108, 111], 'bytes', '')
>>> windows = TokenWindows(torch.arange(10), context=4, stride=1)
>>> len(windows), [t.tolist() for t in windows[0]]
(6, [[0, 1, 2, 3], [1, 2, 3, 4]])
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from gpukit.errors import ConfigError

Tokenizer = Literal["auto", "gpt2", "bytes"]
TOKENIZERS: tuple[Tokenizer, ...] = ("auto", "gpt2", "bytes")
GPT2_VOCAB = 50257  # tokens of GPT-2's BPE; models pad their vocabulary past it (nanoGPT: 50304)


def encode(text: str, tokenizer: Tokenizer = "auto") -> tuple[torch.Tensor, str, str]:
    """``text`` as int64 token ids, what tokenized it: ``"gpt2"`` (tiktoken's BPE, ids below
    50,257) or ``"bytes"`` (UTF-8 bytes, ids below 256), and why bytes where ``"auto"`` fell
    back to them (``"tiktoken is not installed"``; else ``""``). ``"auto"`` takes GPT-2's BPE
    where it loads; ``"gpt2"`` asked by name and not loadable is a ConfigError saying why."""
    if tokenizer not in TOKENIZERS:
        raise ConfigError(
            f"tokenizer={tokenizer!r} is not one of {', '.join(TOKENIZERS)}: 'auto' takes "
            "GPT-2's BPE (tiktoken) where it loads, else bytes"
        )
    if tokenizer == "bytes":
        return _bytes(text), "bytes", ""
    loaded, why = _gpt2_encoding()
    if loaded is not None:
        return torch.tensor(loaded.encode_ordinary(text), dtype=torch.long), "gpt2", ""
    if tokenizer == "gpt2":
        raise ConfigError(
            f"tokenizer='gpt2' needs tiktoken's gpt2 encoding, which {why}: install tiktoken "
            "(pip install tiktoken) on a machine that can download its encoding once, or use "
            "tokenizer='bytes'"
        )
    return _bytes(text), "bytes", why


def _bytes(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _gpt2_encoding() -> tuple[Any, str]:
    """tiktoken's gpt2 encoding, or None with the reason it is not here."""
    if find_spec("tiktoken") is None:
        return None, "tiktoken is not installed"
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2"), ""
    except Exception as err:  # the first use downloads the encoding's files
        return None, f"tiktoken could not load it ({type(err).__name__}: {err})"


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of ``context`` tokens starting every ``stride`` tokens, each with its targets:
    the same tokens shifted by one. ``stride=1`` makes every start a window, as nanoGPT's
    random offsets do (a shuffled loader then draws offsets without repeating one)."""

    def __init__(self, tokens: torch.Tensor, context: int, stride: int) -> None:
        if tokens.numel() <= context:
            raise ConfigError(
                f"{tokens.numel()} tokens are too few for windows of context={context}: "
                f"give a context below {tokens.numel()}"
            )
        self.tokens, self.context, self.stride = tokens, context, stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.context - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        chunk = self.tokens[index * self.stride : index * self.stride + self.context + 1]
        return chunk[:-1], chunk[1:]


class RandomTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``size`` sequences of ``seq_len`` random token ids below ``vocab`` (sequence ``i`` drawn
    from seed ``i``, so every rank and run sees the same) and their next-token targets: data
    for measuring speed, where what is learnt does not matter.

    >>> a, b = RandomTokens(8, 4, vocab=100), RandomTokens(8, 4, vocab=100)
    >>> bool(torch.equal(a[2][0], b[2][0])), bool(torch.equal(a[2][0][1:], a[2][1][:-1]))
    (True, True)
    """

    def __init__(self, seq_len: int, size: int, vocab: int) -> None:
        self.seq_len, self.size, self.vocab = seq_len, size, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(index)
        tokens = torch.randint(self.vocab, (self.seq_len + 1,), generator=generator)
        return tokens[:-1], tokens[1:]
