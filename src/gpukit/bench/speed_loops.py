"""The loops :mod:`gpukit.bench.speed` times: one language model trained on the same batches,
from the same weights, with the same optimizer, three ways.

- ``nanogpt``: plain PyTorch written the way nanoGPT's ``train.py`` writes it: TF32 matmuls,
  bfloat16 autocast around the forward and the loss on a GPU that has bfloat16 (nothing on a
  CPU), ``torch.compile`` where asked, each batch pinned and copied with ``non_blocking=True``
  on a GPU, ``loss.backward()``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``, and
  the loss read back (``loss.item()``) at every ``log_every``-th iteration, counted over every
  call from 0;
- ``runtime``: ``gk.Runtime`` in a user's loop, set to what the nanogpt loop does (its
  precision, compile): ``rt.setup(model, optimizer, loader)``, ``rt.backward``, ``rt.step``,
  ``rt.log(loss=loss)``;
- ``train``: ``gpukit train``'s loop with its default settings (read from its parser) and the
  compile its ``--compile auto`` chooses for a long run: ``rt.train_step`` then
  ``rt.log(loss=loss)``.

Every loop uses nanoGPT's optimizer (AdamW with weight decay on the matrices only, betas 0.9 and
0.95, fused on a GPU), so the loop is all that differs. Each loop keeps the losses it read back
in ``losses``, to check that every way trains the same model alike.

>>> setup = Setup(torch.device("cpu"), TINY, batch=2, compile=False, log_every=2)
>>> batches = make_batches(setup, 4)
>>> loop = nanogpt_loop(setup, batches)
>>> loop(batches)
>>> len(loop.losses)
2
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpukit.bench.train_defaults import runtime_settings
from gpukit.runtime.runtime import Runtime
from gpukit.train import fast
from gpukit.workloads import gpt2
from gpukit.workloads.base import Workload
from gpukit.workloads.llama import llama3_2_1b

Batch = tuple[torch.Tensor, torch.Tensor]
SEED = 0
WEIGHT_DECAY = 0.1  # nanoGPT's, on the matrices only
BETAS = (0.9, 0.95)
# The CPU's size of gpt2 (--quick): two narrow layers, a short context, a small vocabulary.
TINY: dict[str, Any] = {"n_layer": 2, "n_head": 2, "d_model": 64, "context": 64, "vocab_size": 512}


@dataclass(frozen=True)
class Setup:
    """What every loop shares: the device, gpt2's sizes (``{}``: GPT-2 small), the batch in
    sequences, and whether the plain loop and the Runtime loop compile. Every loop reads its
    loss back every ``log_every`` steps: ``gpukit train``'s default (nanoGPT's GPT-2 config
    logs every 10 iterations too)."""

    device: torch.device
    sizes: dict[str, Any]
    batch: int
    compile: bool
    log_every: int = field(default_factory=lambda: int(runtime_settings()["log_every"]))
    model: str = "gpt2"  # or "llama": Llama 3.2 1B's shape (gpukit.bench.speed_fsdp)
    seq_len: int = 2048  # llama's tokens a sequence (gpt2's is its context, in sizes)

    @property
    def precision(self) -> str:
        """bf16-mixed on a GPU with bfloat16 (as nanoGPT's ``dtype`` default), else 32."""
        if self.device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16-mixed"
        return "32"

    def workload(self) -> Workload:
        """gpt2 at these sizes on random tokens, the weights drawn from :data:`SEED`; llama's
        shape on the meta device (its weights are drawn as it is given memory)."""
        if self.model == "llama":
            return llama3_2_1b(seq_len=self.seq_len, batch_size=self.batch, sizes=self.sizes)
        return gpt2.build(seed=SEED, data="random", **self.sizes)


@dataclass
class Loop:
    """A loop ready to run: ``loop(batches)`` trains one step per batch. ``losses``: what it
    read back, in order; ``first``: every step's loss of its first call (kept on the device
    during the call and read after it, so that no step waits for it), to compare the loops'
    first steps one by one. ``close()`` lets go of what the loop set up (a Runtime's)."""

    run: Callable[[Sequence[Batch]], None]
    losses: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    kept: list[torch.Tensor] | None = field(default_factory=list)
    close: Callable[[], None] = lambda: None

    def __call__(self, batches: Sequence[Batch]) -> None:
        self.run(batches)
        if self.kept is not None:
            self.first = [float(loss) for loss in self.kept]
            self.kept = None

    def keep(self, loss: torch.Tensor) -> None:
        """Keep ``loss`` if this is the first call."""
        if self.kept is not None:
            self.kept.append(loss.detach())


def make_batches(setup: Setup, count: int) -> list[Batch]:
    """``count`` batches of ``setup.batch`` sequences of the workload's data, on the CPU (as a
    loader yields them), the same on every call.

    >>> [tuple(t.shape) for t in make_batches(Setup(torch.device("cpu"), TINY, 3, False), 2)[0]]
    [(3, 64), (3, 64)]
    """
    dataset = setup.workload().dataset
    batches = []
    for b in range(count):
        items = [dataset[b * setup.batch + i] for i in range(setup.batch)]
        batches.append((torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])))
    return batches


def nanogpt_optimizer(model: nn.Module, lr: float, device: torch.device) -> torch.optim.AdamW:
    """nanoGPT's ``configure_optimizers``: weight decay on every parameter of two or more
    dimensions (matrices, embeddings), none on the others; fused on a GPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, fused=fused or None)


def _sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt_loop(setup: Setup, batches: Sequence[Batch] = ()) -> Loop:
    """The plain loop (see the module docstring); ``batches`` is unused (as a loop that reads
    its batches as it goes, it needs none before its first call)."""
    device = setup.device
    model: nn.Module = setup.workload().model.to(device)
    optimizer = nanogpt_optimizer(model, gpt2.LR, device)
    if setup.compile:
        model = torch.compile(model)  # type: ignore[assignment]
    autocast: Callable[[], Any] = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if setup.precision == "bf16-mixed"
        else contextlib.nullcontext
    )
    loop = Loop(lambda batches: None)
    cuda = device.type == "cuda"
    iter_num = 0  # over every call, as nanoGPT counts its iterations

    def train(batches: Sequence[Batch]) -> None:
        nonlocal iter_num
        for x, y in batches:
            if cuda:
                x = x.pin_memory().to(device, non_blocking=True)
                y = y.pin_memory().to(device, non_blocking=True)
            with autocast():
                loss = _sequence_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loop.keep(loss)
            if iter_num % setup.log_every == 0:
                loop.losses.append(loss.item())
            iter_num += 1

    loop.run = train
    return loop


class _Feed:
    """The batches of the current call, as a dataset of whole batches (``batch_size=None``),
    so that one loader set up once yields each call's batches."""

    def __init__(self) -> None:
        self.batches: Sequence[Batch] = ()

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index]

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)


def runtime_loop(setup: Setup, batches: Sequence[Batch]) -> Loop:
    """``gk.Runtime`` in a user's loop, with the plain loop's precision and compile; its
    loader is set up over ``batches`` (``rt.setup`` checks that a loader has batches)."""
    rt = Runtime(
        devices=str(setup.device),
        precision=setup.precision,
        compile=setup.compile,
        log_every=setup.log_every,
    )
    return _runtime_loop(rt, setup, batches, train_step=False)


def train_loop(setup: Setup, batches: Sequence[Batch]) -> Loop:
    """``gpukit train``'s loop with its default Runtime settings on ``setup.device``, and the
    compile ``--compile auto`` chooses for a run long enough to repay it (on a GPU)."""
    chosen = fast.compile_choice(
        "auto",
        cuda=setup.device.type == "cuda",
        strategy="single",
        devices=1,
        steps=fast.COMPILE_FROM_STEPS,
        parameters=sum(p.numel() for p in setup.workload().model.parameters()),
    )
    rt = Runtime(**runtime_settings(devices=str(setup.device)), compile=chosen.setting)
    return _runtime_loop(rt, setup, batches, train_step=True)


def _runtime_loop(rt: Runtime, setup: Setup, batches: Sequence[Batch], train_step: bool) -> Loop:
    workload = setup.workload()
    optimizer = nanogpt_optimizer(workload.model, gpt2.LR, setup.device)
    return runtime_loop_of(rt, workload.model, optimizer, _sequence_loss, batches, train_step)


def runtime_loop_of(
    rt: Runtime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batches: Sequence[Batch],
    train_step: bool,
) -> Loop:
    """A user's loop over ``rt``: ``model`` and ``optimizer`` set up with a loader of each
    call's batches (``batches``: the first call's, which ``rt.setup`` checks), the loss
    ``loss_of(logits, targets)``, a step by ``rt.train_step`` or by ``rt.backward`` and
    ``rt.step``, then ``rt.log(loss=loss)``."""
    feed = _Feed()
    feed.batches = batches
    data: torch.utils.data.DataLoader[Batch] = torch.utils.data.DataLoader(
        feed,  # type: ignore[arg-type]
        batch_size=None,
        shuffle=False,
    )
    model, optimizer, loader = rt.setup(model, optimizer, data)
    loop = Loop(lambda batches: None, close=rt.teardown)
    read = 0  # the history records already handed to loop.losses

    def collect() -> None:
        nonlocal read
        records = rt.history[read:]
        loop.losses.extend(float(r["loss"]) for r in records if "loss" in r)
        read += len(records)

    def compute_loss(batch: Batch) -> torch.Tensor:
        x, y = batch
        return loss_of(model(x), y)

    def train(batches: Sequence[Batch]) -> None:
        feed.batches = batches
        for batch in loader:  # on the device: the loader moves it
            if train_step:
                loss = rt.train_step(optimizer, batch, compute_loss)
            else:
                loss = compute_loss(batch)
                rt.backward(loss)
                rt.step(optimizer)
            rt.log(loss=loss)
            loop.keep(loss)
        collect()

    loop.run = train
    return loop


BUILDERS: dict[str, Callable[[Setup, Sequence[Batch]], Loop]] = {
    "nanogpt": nanogpt_loop,
    "runtime": runtime_loop,
    "train": train_loop,
}
