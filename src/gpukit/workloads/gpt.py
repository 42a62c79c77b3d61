"""``gpt``: a character-level decoder-only transformer on bundled public-domain text.

The model is nanoGPT in miniature: learned token and position embeddings, pre-LayerNorm
blocks of causal self-attention (``scaled_dot_product_attention`` with ``is_causal=True``) and
a 4x MLP, a final LayerNorm and an output layer tied to the token embedding. Its dataset cuts
the text into windows of ``context + 1`` characters; the input is the first ``context`` and
the target the same characters shifted by one, so every position predicts the next character.

>>> w = build(seed=0)
>>> x, y = w.dataset[0]
>>> x.shape, bool(torch.equal(x[1:], y[:-1]))
(torch.Size([64]), True)
>>> text = w.sample(w.model, torch.device("cpu"))  # untrained: gibberish, but 200 characters
>>> len(text)
200

The validation set is other public-domain text, bundled apart (``heldout.txt``: none of it is
in the training text), cut into windows that do not overlap; the training set is the whole
training text, as without it.

>>> len(w.validation), w.validation.vocab == w.dataset.vocab
(74, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from gpukit.errors import ConfigError
from gpukit.strategies.sequence_batches import sequence_positions
from gpukit.workloads.base import Workload

STRIDE = 8  # characters between window starts: windows overlap, so an epoch sees each ~8 times


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape. With the defaults an epoch of the bundled text (317 steps of 32
    windows) takes 5-8 s on 2 CPU cores, and the 8 default epochs about a minute.

    >>> GPTConfig(vocab_size=65).d_model // GPTConfig(vocab_size=65).n_head
    16
    """

    vocab_size: int
    context: int = 64
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    dropout: float = 0.0
    bias: bool = True  # in the linear layers and LayerNorms (nanoGPT trains GPT-2 without)


def corpus(name: str = "corpus") -> str:
    """The bundled training text (``"heldout"``: the validation text), without its one-line
    header.

    >>> corpus()[:200].isascii(), corpus("heldout")[:8]
    (True, 'INVICTUS')
    """
    path = resources.files("gpukit.workloads") / "data" / f"{name}.txt"
    text = path.read_text(encoding="ascii")
    return text.split("\n", 1)[1]


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows over ``text`` as ``(input, target)`` pairs of character ids (int64).

    Window ``i`` starts at character ``i * stride``; ``vocab`` maps ids back to characters
    (default: the text's own characters; give another dataset's to share its ids).

    >>> ds = CharDataset("hello world", context=4, stride=2)
    >>> len(ds), ds.decode(ds[0][0].tolist()), ds.decode(ds[0][1].tolist())
    (4, 'hell', 'ello')
    """

    def __init__(
        self, text: str, context: int, stride: int = STRIDE, vocab: str | None = None
    ) -> None:
        if len(text) <= context:
            raise ValueError(f"text of {len(text)} characters is too short for context={context}")
        self.vocab = vocab if vocab is not None else "".join(sorted(set(text)))
        self.index = {ch: i for i, ch in enumerate(self.vocab)}
        self.data = torch.tensor(self.encode(text), dtype=torch.long)
        self.context = context
        self.stride = stride

    def encode(self, text: str) -> list[int]:
        """Character ids of ``text``; every character must be in ``vocab``."""
        return [self.index[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        """The characters ``ids`` stand for."""
        return "".join(self.vocab[i] for i in ids)

    def __len__(self) -> int:
        return (len(self.data) - self.context - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = (i % len(self)) * self.stride
        chunk = self.data[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError(f"d_model={config.d_model} is not a multiple of n_head")
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads counted from the projection's width, not n_head: split across tensor-parallel
        # ranks, each rank's qkv holds whole heads of q, k and v, fewer than n_head.
        batch, time, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(out.transpose(1, 2).reshape(batch, time, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias),
            nn.GELU(),
            nn.Linear(4 * config.d_model, config.d_model, bias=config.bias),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Maps character ids ``(batch, time)`` to next-character logits ``(batch, time, vocab)``.

    >>> model = GPT(GPTConfig(vocab_size=10, context=8))
    >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 5, 10])
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.Sequential(*(Block(config) for _ in range(config.n_layer)))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: fewer parameters, learns faster
        self.apply(self._init_weights)
        # GPT-2's scaling: each residual branch's output starts small, so the sum over
        # 2 * n_layer branches keeps unit variance.
        for name, param in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds only some of these (the others None): a later stage is
        # given the hidden states instead of ids, an earlier one hands its hidden states on.
        x = ids
        if self.token_embedding is not None:
            # The tokens' places in the whole sequence: under context parallelism this rank
            # holds only some of them (arange otherwise).
            positions = sequence_positions(ids.shape[1], ids.device)
            x = self.drop(self.token_embedding(ids) + self.position_embedding(positions))
        x = self.blocks(x)
        return x if self.head is None else self.head(self.ln_f(x))


class SequenceCrossEntropy(nn.Module):
    """Cross entropy of ``(batch, time, vocab)`` logits against ``(batch, time)`` ids, averaged
    over every position of every sequence."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def flops_per_sample(model: GPT) -> float:
    """Training FLOPs (forward + backward) of one window, as nanoGPT and PaLM estimate them:

    ``T * (6 * N + 12 * L * T * d)`` with ``T`` the context, ``N`` the parameters without the
    position embedding (the tied token embedding counts once, as the output layer's matmul),
    ``L`` layers and ``d`` the width. ``6 * N`` per token is 2 for the forward multiply-add of
    each weight and 4 for the backward; ``12 * L * T * d`` is the same for the attention
    scores and the weighted sum (4 * L * T * d forward), counted as if not causal.

    >>> model = GPT(GPTConfig(vocab_size=10, context=8, n_layer=1, d_model=16, n_head=2))
    >>> n = sum(p.numel() for p in model.parameters()) - 8 * 16
    >>> flops_per_sample(model) == 8 * (6 * n + 12 * 1 * 8 * 16)
    True
    """
    c = model.config
    n = sum(p.numel() for p in model.parameters()) - model.position_embedding.weight.numel()
    return float(c.context * (6 * n + 12 * c.n_layer * c.context * c.d_model))


class Sampler:
    """Writes text with a trained :class:`GPT`: ``sampler(model, device) -> str``.

    Starts from ``prompt`` (default: a newline), draws each next character from the softmax
    at ``temperature`` with a fixed generator (the same model gives the same text), and
    returns the ``length`` new characters. Runs in eval mode under ``no_grad``, and restores
    the model's mode. Give it the model itself, not a DDP or DataParallel wrapper (``fit``
    passes ``rt.unwrap(model)``); a ``torch.compile``'d model is sampled uncompiled.

    >>> sampler = Sampler("ab", length=5)
    >>> len(sampler(GPT(GPTConfig(vocab_size=2, context=4)), torch.device("cpu"), length=7))
    7
    """

    def __init__(
        self,
        vocab: str,
        *,
        length: int = 200,
        prompt: str | None = None,
        temperature: float = 0.8,
        seed: int = 0,
        context: int | None = None,
    ) -> None:
        if prompt is None:  # start of a line, as the text's own lines start
            prompt = "\n" if "\n" in vocab else vocab[0]
        unknown = sorted(set(prompt) - set(vocab))
        if unknown:
            raise ValueError(f"prompt has characters outside the vocabulary: {unknown}")
        self.vocab = vocab
        self.length = length
        self.prompt = prompt
        self.temperature = temperature
        self.seed = seed
        self.context = context  # the model's window (default: read off a GPT)

    def __call__(self, model: nn.Module, device: torch.device, length: int | None = None) -> str:
        # A torch.compile'd model is sampled through the module it wraps: that one has the
        # config, and running the wrapper in eval mode would cost a recompile for a few hundred
        # small forwards. No other wrapper is looked through: fit passes rt.unwrap(model).
        net: nn.Module = getattr(model, "_orig_mod", model)
        context = self.context or (net.config.context if isinstance(net, GPT) else None)
        was_training = net.training
        net.eval()
        try:
            with torch.no_grad():
                ids = self._generate(
                    net, device, context, self.length if length is None else length
                )
        finally:
            net.train(was_training)
        return "".join(self.vocab[i] for i in ids)

    def _generate(
        self, net: nn.Module, device: torch.device, context: int | None, length: int
    ) -> list[int]:
        # Draw on the CPU with a CPU generator: the same text whatever device the model is on.
        gen = torch.Generator().manual_seed(self.seed)
        ids = [self.vocab.index(ch) for ch in self.prompt]
        new: list[int] = []
        for _ in range(length):
            window = ids[-context:] if context else ids
            last = len(window) - 1
            if context:
                # Padded at the end to one fixed shape (causal attention keeps the padding out
                # of position ``last``): a compiled model then sees one shape, not 64.
                window = window + [0] * (context - len(window))
            logits = net(torch.tensor([window], device=device))[0, last].float().cpu()
            probs = F.softmax(logits / self.temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
            ids.append(nxt)
            new.append(nxt)
        return new


def build(seed: int = 0, config: GPTConfig | None = None) -> Workload:
    """The ``gpt`` workload, its weights drawn from ``seed`` (global RNG left untouched).

    ``config`` defaults to :class:`GPTConfig` with the corpus's vocabulary; the dataset's
    ``vocab`` and the workload's ``sample.vocab`` hold the characters.

    >>> w = build()
    >>> w.sample.vocab == w.dataset.vocab, w.batch_size, w.epochs
    (True, 32, 8)
    """
    text = corpus()
    config = config or GPTConfig(vocab_size=len(set(text)))
    dataset = CharDataset(text, config.context, STRIDE)
    held_out = CharDataset(corpus("heldout"), config.context, config.context, dataset.vocab)
    if config.vocab_size < len(dataset.vocab):
        raise ConfigError(
            f"GPTConfig(vocab_size={config.vocab_size}) is too small for the text's "
            f"{len(dataset.vocab)} characters; leave config=None or raise vocab_size"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
    return Workload(
        name="gpt",
        model=model,
        dataset=dataset,
        loss=SequenceCrossEntropy(),
        batch_size=32,
        lr=3e-3,
        epochs=8,
        flops_per_sample=flops_per_sample(model),
        sample=Sampler(dataset.vocab, context=config.context),
        validation=held_out,
    )
