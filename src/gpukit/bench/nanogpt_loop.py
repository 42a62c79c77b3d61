"""A training script's loop in nanoGPT's habits, for ``gpukit bench trace --workload nanogpt``.

``gpukit train``'s loop (the ``gpt`` workload) is gpukit's own: a DataLoader, ``rt.train_step``
and ``rt.log``. Most people trace a script of their own instead, and most such scripts follow
the habits nanoGPT's ``train.py`` made common, which ask other things of a trace:

- the text as token ids (``uint16``) in a ``np.memmap``, opened anew for every batch;
- a batch as ``torch.randint`` offsets, each row a slice of the memmap cut at a 0-dim CPU
  tensor (numpy reads it through ``Tensor.__index__``), ``torch.from_numpy`` of each slice and
  ``torch.stack`` of the rows; on a GPU, pinned and copied with ``non_blocking=True``;
- the next batch drawn while the current one trains, right after its forward;
- AdamW with weight decay on the matrices only, a cosine learning rate with warm-up set by hand
  in ``param_groups``, gradient clipping, ``zero_grad(set_to_none=True)``;
- ``loss.item()`` every ``log_interval`` iterations, and every ``eval_interval`` the mean loss
  of ``eval_iters`` batches of each split under ``torch.no_grad()``, as a logged line.

The model is the ``gpt`` workload's :class:`~gpukit.workloads.gpt.GPT`, at the size nanoGPT
suggests for a CPU (4 layers, 4 heads, width 128, context 64, 12 sequences a batch). Each call
of the loop runs its iterations from 0, so that two calls do the same work (evaluations and
logged lines included) and can be timed against each other.

>>> with nanogpt_loop(NanoGPTConfig(n_layer=1, n_embd=16, n_head=2, eval_iters=1)) as loop:
...     loop(3)
>>> loop.logged[0].startswith("iter 0: train loss")
True
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from gpukit.devices import device as best_device
from gpukit.workloads.gpt import GPT, GPTConfig, corpus


@dataclass(frozen=True)
class NanoGPTConfig:
    """The script's settings, named as nanoGPT names them; the defaults are its CPU sizes,
    with the intervals shortened to fit a 20-iteration timing."""

    block_size: int = 64
    batch_size: int = 12
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 5
    lr_decay_iters: int = 200
    weight_decay: float = 0.1
    beta2: float = 0.99
    grad_clip: float = 1.0
    gradient_accumulation_steps: int = 1
    log_interval: int = 5
    eval_interval: int = 10
    eval_iters: int = 2


class NanoGPTLoop:
    """``loop(iters)`` trains ``iters`` iterations; ``logged`` keeps the lines a script would
    print (the loss at each log interval, the estimates at each evaluation)."""

    def __init__(
        self, folder: Path, config: NanoGPTConfig, device: torch.device, seed: int = 0
    ) -> None:
        self.folder = folder
        self.config = config
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        self.logged: list[str] = []
        vocab_size = _prepare(folder)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = GPT(
                GPTConfig(
                    vocab_size=vocab_size,
                    context=config.block_size,
                    n_layer=config.n_layer,
                    n_head=config.n_head,
                    d_model=config.n_embd,
                )
            )
        self.model = model.to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        cuda = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            groups, lr=config.learning_rate, betas=(0.9, config.beta2), fused=cuda or None
        )
        dtype = torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float16
        self.autocast = torch.autocast("cuda", dtype=dtype) if cuda else contextlib.nullcontext()
        # Only float16 needs loss scaling; everywhere else the scaler passes calls through.
        self.scaler = torch.amp.GradScaler(device.type, enabled=cuda and dtype == torch.float16)
        self.batch = self.get_batch("train")

    def get_batch(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` windows of ``block_size`` tokens from ``split`` ("train" or "val"),
        and the same windows shifted by one token (the targets)."""
        # Opened for every batch: a memmap kept open holds its pages in memory.
        data = np.memmap(self.folder / f"{split}.bin", dtype=np.uint16, mode="r")
        size = self.config.block_size
        ix = torch.randint(len(data) - size, (self.config.batch_size,), generator=self.generator)
        x = torch.stack([torch.from_numpy(data[i : i + size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + size].astype(np.int64)) for i in ix])
        if self.device.type == "cuda":
            return (
                x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True),
            )
        return x.to(self.device), y.to(self.device)

    def lr_at(self, it: int) -> float:
        """Linear warm-up, then cosine decay down to ``min_lr``."""
        c = self.config
        if it < c.warmup_iters:
            return c.learning_rate * (it + 1) / (c.warmup_iters + 1)
        if it > c.lr_decay_iters:
            return c.min_lr
        progress = (it - c.warmup_iters) / (c.lr_decay_iters - c.warmup_iters)
        return c.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.learning_rate - c.min_lr)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast:
            logits = self.model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    @torch.no_grad()
    def estimate_loss(self) -> dict[str, torch.Tensor]:
        """The mean loss of ``eval_iters`` batches of each split, in eval mode."""
        found = {}
        self.model.eval()
        for split in ("train", "val"):
            losses = torch.zeros(self.config.eval_iters)
            for k in range(self.config.eval_iters):
                losses[k] = self.loss(*self.get_batch(split)).item()
            found[split] = losses.mean()
        self.model.train()
        return found

    def __call__(self, iters: int) -> None:
        c = self.config
        x, y = self.batch
        started = time.time()
        for iter_num in range(iters):
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr_at(iter_num)
            if iter_num % c.eval_interval == 0:
                losses = self.estimate_loss()
                self.logged.append(
                    f"iter {iter_num}: train loss {losses['train']:.4f}, "
                    f"val loss {losses['val']:.4f}"
                )
            for _ in range(c.gradient_accumulation_steps):
                loss = self.loss(x, y) / c.gradient_accumulation_steps
                x, y = self.get_batch("train")  # drawn while the device works on this step
                self.scaler.scale(loss).backward()
            if c.grad_clip:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if iter_num % c.log_interval == 0:
                took, started = time.time() - started, time.time()
                lossf = loss.item() * c.gradient_accumulation_steps
                self.logged.append(f"iter {iter_num}: loss {lossf:.4f}, time {took * 1e3:.2f}ms")
        self.batch = x, y
        del self.logged[:-100]  # the latest lines are enough; a long timing keeps no more


def _prepare(folder: Path) -> int:
    """Write the bundled text as token ids to ``train.bin`` (90%) and ``val.bin``, as
    nanoGPT's data preparation does; the vocabulary's size."""
    text = corpus()
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = np.array([index[ch] for ch in text], dtype=np.uint16)
    cut = int(0.9 * len(ids))
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    return len(vocab)


@contextlib.contextmanager
def nanogpt_loop(
    config: NanoGPTConfig | None = None, device: torch.device | str | None = None, seed: int = 0
) -> Iterator[NanoGPTLoop]:
    """The loop on ``device`` (default: the best one), its data in a temporary folder that is
    removed when the block ends."""
    dev = torch.device(device) if device is not None else best_device().torch
    with tempfile.TemporaryDirectory(prefix="gpukit-nanogpt-") as folder:
        yield NanoGPTLoop(Path(folder), config or NanoGPTConfig(), dev, seed)
