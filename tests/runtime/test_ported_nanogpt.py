"""A program written like nanoGPT's train.py trains bit for bit alike, plain and ported to
gpukit, in 1 process and in 2 gloo processes.

The habits kept: no DataLoader, ``get_batch`` samples ``torch.randint`` offsets into an
``np.memmap`` of uint16 tokens (reopened at each call) and stacks
``torch.from_numpy(data[i:i+block_size].astype(np.int64))`` slices; per-rank seeds
(``torch.manual_seed(1337 + seed_offset)``, seed_offset = rank, so every rank samples its own
batches, and DDP broadcasts rank 0's initial weights); a tiny GPT with dropout (embedding,
attention and residual dropout, tied embedding and head, its own weight init); AdamW over
a decay and a no-decay parameter group; ``gradient_accumulation_steps`` divided by the number
of processes; a warmup-cosine learning rate written into ``param_groups`` by hand; an
evaluation on the master process only (its batches come from rank 0's generator alone); in the
micro-step loop the next batch drawn right after the forward; ``loss /
gradient_accumulation_steps`` and ``model.require_backward_grad_sync = (micro_step ==
gradient_accumulation_steps - 1)``; ``clip_grad_norm_(model.parameters(), grad_clip)``;
``optimizer.zero_grad(set_to_none=True)``; ``loss.item()`` every ``log_interval`` on the master;
``iter_num`` counted up to ``if iter_num > max_iters: break`` (max_iters + 1 steps).

The port: ``gk.Runtime(accumulate=..., clip=grad_clip, log_every=log_interval)``, the user's
own per-rank seed called after making the Runtime (which then seeds nothing itself),
``rt.backward(loss)`` on the undivided loss (gpukit divides by ``accumulate``), ``rt.step``,
``rt.log(loss=loss)`` instead of ``.item()``, and ``rt.flush_logs()`` for the last window
(no loader pass ends to close it). Variants:

- ``nanogpt``: ``rt.step`` after every ``rt.backward`` (the README's loop);
- ``nanogpt_one_step_call``: ``rt.step`` once after the micro-steps, where nanoGPT calls
  ``optimizer.step()``;
- ``nanogpt_one_group``: the same program with one parameter group (``AdamW(model.parameters())``)
  on both sides. There the optimizer lists the parameters in ``model.parameters()``'s order,
  the order nanoGPT clips them in; with the two groups it lists the matrices first. The total
  gradient norm is a float32 sum over per-parameter norms, so its last bit depends on that
  order, and with it the clipping factor applied to every gradient;
- ``nanogpt_one_group_one_step_call``: both of the above.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gpukit as gk
from tests.fakes import spawn_plain_program

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("ported-nanogpt")

N_LAYER, N_HEAD, N_EMBD, VOCAB, BLOCK, DROPOUT = 2, 2, 32, 65, 16, 0.1
BATCH_SIZE, GRAD_ACCUM = 4, 4  # GRAD_ACCUM is global: each of N ranks runs GRAD_ACCUM // N
LEARNING_RATE, MIN_LR, WARMUP_ITERS, LR_DECAY_ITERS = 3e-3, 3e-4, 2, 6
MAX_ITERS, EVAL_INTERVAL, EVAL_ITERS, LOG_INTERVAL = 6, 3, 2, 2
GRAD_CLIP = 0.5  # below the gradient norms here (about 1.4 at first), so clipping scales them
Result = dict[str, Any]


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = (
            t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2)
            for t in self.c_attn(x).split(N_EMBD, dim=2)
        )
        p = DROPOUT if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.mlp = nn.Sequential(
            nn.Linear(N_EMBD, 4 * N_EMBD),
            nn.GELU(),
            nn.Linear(4 * N_EMBD, N_EMBD),
            nn.Dropout(DROPOUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, N_EMBD),
                "wpe": nn.Embedding(BLOCK, N_EMBD),
                "drop": nn.Dropout(DROPOUT),
                "h": nn.ModuleList(Block() for _ in range(N_LAYER)),
                "ln_f": nn.LayerNorm(N_EMBD),
            }
        )
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)  # draws from the global generator: per rank
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, groups: bool) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if not groups:
            return torch.optim.AdamW(params, lr=LEARNING_RATE, betas=(0.9, 0.95))
        decay = {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1}
        no_decay = {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}
        return torch.optim.AdamW([decay, no_decay], lr=LEARNING_RATE, betas=(0.9, 0.95))


def write_tokens(folder: Path) -> None:
    """What nanoGPT's prepare.py leaves: train.bin and val.bin of uint16 tokens."""
    rng = np.random.default_rng(3)
    for split, n in (("train", 3000), ("val", 600)):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(folder / f"{split}.bin")


def get_batch(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    data = np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - BLOCK, (BATCH_SIZE,))
    x = torch.stack([torch.from_numpy(data[i : i + BLOCK].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + BLOCK].astype(np.int64)) for i in ix])
    return x, y


def get_lr(it: int) -> float:
    if it < WARMUP_ITERS:
        return LEARNING_RATE * (it + 1) / (WARMUP_ITERS + 1)
    if it > LR_DECAY_ITERS:
        return MIN_LR
    ratio = (it - WARMUP_ITERS) / (LR_DECAY_ITERS - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LEARNING_RATE - MIN_LR)


@torch.no_grad()
def estimate_loss(model: nn.Module, folder: Path) -> dict[str, float]:
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(EVAL_ITERS)
        for k in range(EVAL_ITERS):
            _, loss = model(*get_batch(folder, split))
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def _step_counter(optimizer: torch.optim.Optimizer) -> list[int]:
    """Counts real ``optimizer.step()`` calls, whoever makes them."""
    count = [0]
    optimizer.register_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def _result(model: nn.Module, steps: int, **extra: Any) -> Result:
    return {
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "steps": steps,
        "rng": torch.get_rng_state(),
        **extra,
    }


def plain_train(rank: int, folder: Path, name: str) -> Result:
    ddp = dist.is_initialized()
    master_process, seed_offset = rank == 0, rank
    gradient_accumulation_steps = GRAD_ACCUM // (dist.get_world_size() if ddp else 1)
    torch.manual_seed(1337 + seed_offset)
    model: Any = GPT()
    optimizer = model.configure_optimizers(groups="one_group" not in name)
    steps = _step_counter(optimizer)
    if ddp:
        model = DDP(model)
    raw_model = model.module if ddp else model
    evals, logged, every_loss = [], [], []
    X, Y = get_batch(folder, "train")
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 and master_process:
            evals.append(estimate_loss(model, folder))
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = get_batch(folder, "train")  # the next batch, while the device would be busy
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        every_loss.append(loss.detach() * gradient_accumulation_steps)  # the test's, for rt.log
        if iter_num % LOG_INTERVAL == 0 and master_process:
            logged.append(loss.item() * gradient_accumulation_steps)
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    return _result(raw_model, steps[0], evals=evals, logged=logged, every_loss=every_loss)


def gpukit_train(rt: gk.Runtime, folder: Path, name: str) -> Result:
    master_process, seed_offset = rt.is_global_zero, rt.rank
    torch.manual_seed(1337 + seed_offset)  # the program's own per-rank seed, after the Runtime
    model: Any = GPT()
    optimizer = model.configure_optimizers(groups="one_group" not in name)
    steps = _step_counter(optimizer)
    model, optimizer = rt.setup(model, optimizer)
    raw_model = rt.unwrap(model)
    evals = []
    X, Y = get_batch(folder, "train")
    iter_num = 0
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % EVAL_INTERVAL == 0 and master_process:
            evals.append(estimate_loss(model, folder))
        for _ in range(rt.accumulate):
            _, loss = model(X, Y)
            X, Y = get_batch(folder, "train")
            rt.backward(loss)  # undivided: rt.backward divides by accumulate
            if "one_step_call" not in name:
                rt.step(optimizer)  # clips and steps on the window's last micro-step only
        if "one_step_call" in name:
            rt.step(optimizer)  # where nanoGPT calls optimizer.step()
        rt.log(loss=loss)
        iter_num += 1
        if iter_num > MAX_ITERS:
            break
    rt.flush_logs()  # the last, partial window: no loader pass ends here to close it
    return _result(raw_model, steps[0], evals=evals, history=rt.history)


PLAIN = ["nanogpt", "nanogpt_one_group"]
# port -> the plain program it must equal
PORTS = {
    "nanogpt": "nanogpt",
    "nanogpt_one_step_call": "nanogpt",
    "nanogpt_one_group": "nanogpt_one_group",
    "nanogpt_one_group_one_step_call": "nanogpt_one_group",
}


def _settings(world: int) -> dict[str, Any]:
    """The port's Runtime: nanoGPT's gradient_accumulation_steps //= ddp_world_size."""
    return {"accumulate": GRAD_ACCUM // world, "clip": GRAD_CLIP, "log_every": LOG_INTERVAL}


# -- running them ------------------------------------------------------------------------------


def _plain_worker(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)  # two processes on two cores (the ports' too)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name in PLAIN:
            torch.save(
                plain_train(rank, Path(folder), name), Path(folder) / f"plain-{name}-{rank}.pt"
            )
    finally:
        dist.destroy_process_group()


def _gpukit_worker(rt: gk.Runtime, folder: str) -> None:
    torch.set_num_threads(1)
    for name in PORTS:
        # One Runtime per variant, as a script under `gpukit launch` makes it: it joins the
        # process group the launched one holds.
        own = gk.Runtime(strategy="ddp", devices=["cpu", "cpu"], **_settings(2))
        try:
            result = gpukit_train(own, Path(folder), name)
        finally:
            own.teardown()
        torch.save(result, Path(folder) / f"gpukit-{name}-{rt.rank}.pt")


Results = dict[str, Any]


@pytest.fixture(
    scope="module",
    params=[1, pytest.param(2, marks=pytest.mark.processes)],
    ids=["1 process", "2 processes"],
)
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Results:
    """``results["plain-nanogpt"][rank]``, ``results["gpukit-nanogpt_one_step_call"][rank]``,
    ...; ``results["world"]``."""
    world = request.param
    folder = tmp_path_factory.mktemp(f"ported-nanogpt-{world}")
    write_tokens(folder)  # prepare.py, before training
    out: Results = {"world": world}
    if world == 1:  # here: plain without DDP, and ports on Runtime(devices="cpu")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for name in PLAIN:
                out[f"plain-{name}"] = [plain_train(0, folder, name)]
            for name in PORTS:
                rt = gk.Runtime(devices="cpu", **_settings(1))
                out[f"gpukit-{name}"] = [gpukit_train(rt, folder, name)]
        finally:
            torch.set_num_threads(threads)
        return out
    spawn_plain_program(_plain_worker, str(folder), 2)
    gk.Runtime(strategy="ddp", devices=["cpu", "cpu"]).launch(_gpukit_worker, str(folder))
    for side, names in (("plain", PLAIN), ("gpukit", list(PORTS))):
        for name in names:
            out[f"{side}-{name}"] = [
                torch.load(folder / f"{side}-{name}-{r}.pt", weights_only=False) for r in (0, 1)
            ]
    return out


@pytest.mark.parametrize("port", list(PORTS))
def test_the_nanogpt_loop_trains_as_its_plain_program(results: Results, port: str) -> None:
    plain, ported = results[f"plain-{PORTS[port]}"], results[f"gpukit-{port}"]
    for rank, (want, got) in enumerate(zip(plain, ported, strict=True)):
        assert got["steps"] == want["steps"] == MAX_ITERS + 1  # `if iter_num > max_iters`
        differ = [
            f"{k} (max abs diff {(w.double() - got['weights'][k].double()).abs().max():.3g})"
            for k, w in want["weights"].items()
            if not torch.equal(w, got["weights"][k])
        ]
        assert not differ, f"{port} rank {rank}: weights differ from the plain program: {differ}"
        assert torch.equal(got["rng"], want["rng"]), f"{port} rank {rank}: random state differs"
        # The master's evaluations (batches from rank 0's generator alone), only there.
        assert got["evals"] == want["evals"]
        assert len(got["evals"]) == (math.ceil((MAX_ITERS + 1) / EVAL_INTERVAL) if rank == 0 else 0)


@pytest.mark.parametrize("port", list(PORTS))
def test_rt_log_replaces_the_masters_loss_item(results: Results, port: str) -> None:
    plain, ported = results[f"plain-{PORTS[port]}"], results[f"gpukit-{port}"]
    # Each iteration's last micro-step loss (undivided), averaged over the ranks.
    every = torch.stack([torch.stack(r["every_loss"]) for r in plain]).double().mean(dim=0)
    windows = [every[i : i + LOG_INTERVAL].mean().item() for i in range(0, MAX_ITERS + 1, 2)]
    for got in ported:  # the same history on every rank
        assert [h["step"] for h in got["history"]] == [2, 4, 6, 7]
        assert [h["loss"] for h in got["history"]] == pytest.approx(windows, rel=1e-6)
    # What nanoGPT's master printed: the first iteration of each window, its own rank's.
    own = [r.item() for r in torch.stack(plain[0]["every_loss"])[::LOG_INTERVAL].double()]
    assert plain[0]["logged"] == own
