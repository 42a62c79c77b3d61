"""Every parallelism dimension and every pair of them on 4 gloo ranks (2 x 2), trained as a
user trains with gpukit (``rt.setup``, ``rt.setup_criterion``, ``rt.train_step``,
``rt.log``): the losses of 20 steps of a small GPT equal the plain one-process loop's within
float32's rounding of the reordered sums (float8: within its own rounding), and the host reads
per step are the same at every step, and as many as plain DDP's (``gk.trace()``).

All layouts run in one launch (each a Runtime of its own over the same 4 processes), so the
processes start once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpukit as gk
from gpukit.workloads.gpt import GPT, GPTConfig, SequenceCrossEntropy

# One worker runs the module: its launch is made once, by a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.xdist_group("parallel-pairs")]

STEPS, BATCH, CONTEXT, LR = 20, 8, 16, 3e-3
CONFIG = GPTConfig(vocab_size=32, context=CONTEXT, n_layer=2, n_head=4, d_model=32)

# The layouts over 4 ranks: each dimension beside data sharding, and each pair.
LAYOUTS: dict[str, dict[str, Any]] = {
    "replicas x shards": {"dp_replicate": 2, "dp_shard": 2},
    "tp x shards": {"tp": 2, "dp_shard": 2},
    "tp x replicas": {"tp": 2, "dp_replicate": 2, "dp_shard": 1},
    "float8 x shards": {"dp_shard": 4, "float8": "rowwise"},
    "float8 x tp": {"tp": 2, "dp_shard": 2, "float8": "rowwise"},
    "cp x shards": {"cp": 2, "dp_shard": 2},
    "cp x replicas": {"cp": 2, "dp_replicate": 2, "dp_shard": 1},
    "cp x tp": {"cp": 2, "tp": 2, "dp_shard": 1},
    "float8 x cp": {"cp": 2, "dp_shard": 2, "float8": "rowwise"},
    "pp x shards": {"pp": 2, "dp_shard": 2},
    "pp x replicas": {"pp": 2, "dp_replicate": 2, "dp_shard": 1},
    "pp x tp": {"pp": 2, "tp": 2, "dp_shard": 1},
    "float8 x pp": {"pp": 2, "dp_shard": 2, "float8": "rowwise"},
    "pp x cp": {"pp": 2, "cp": 2, "dp_shard": 1},
}
TOLERANCE = {"float8": 0.02}  # relative, per step's loss; float32 otherwise: 2e-5


def _model() -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(CONFIG)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONTEXT + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _plain() -> list[float]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    criterion, losses = SequenceCrossEntropy(), []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _train(rt: gk.Runtime, layout: dict[str, Any] | None) -> dict[str, Any]:
    # None: plain DDP over the same ranks, whose host reads each layout's are held to.
    how: dict[str, Any] = {"parallel": layout} if layout is not None else {"strategy": "ddp"}
    inner = gk.Runtime(**how, devices="cpu", seed=0, log_every=1)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = inner.setup(model, optimizer)
    criterion = inner.setup_criterion(SequenceCrossEntropy())
    shards = inner.strategy.sampler_placement()[0]
    batches = [_batch(step) for step in range(STEPS)]
    data = torch.utils.data.TensorDataset(*(torch.cat(t) for t in zip(*batches, strict=True)))
    loader = inner.setup(torch.utils.data.DataLoader(data, batch_size=BATCH // shards))
    reads = []
    for piece in loader:  # this rank's samples of each step, cut along the sequence under cp
        with gk.trace() as t:
            loss = inner.train_step(optimizer, piece, lambda b: criterion(model(b[0]), b[1]))
            inner.log(loss=loss)
        reads.append(sum(s.count for s in t.syncs))
    losses = [h["loss"] for h in inner.history]
    inner.teardown()
    return {"losses": losses, "reads": reads}


def _all(rt: gk.Runtime, names: list[str] | None = None) -> dict[str, Any]:
    # "ddp": plain DDP over the same ranks, whose host reads each layout's are held to.
    layouts: dict[str, dict[str, Any] | None] = {**LAYOUTS, "ddp": None}
    return {n: _train(rt, layouts[n]) for n in [*(names or LAYOUTS), "ddp"]}


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    rt = gk.Runtime(strategy="ddp", devices=["cpu"] * 4)
    return rt.launch(_all)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_trains_as_one_process(name: str, runs: dict[str, Any]) -> None:
    got, want = runs[name]["losses"], _plain()
    assert len(got) == STEPS
    tolerance = next((v for k, v in TOLERANCE.items() if k in name), 2e-5)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=tolerance, atol=0)
    reads = runs[name]["reads"]
    assert len(set(reads[2:])) == 1, f"host reads per step vary: {reads}"  # after warm-up
    ddp = runs["ddp"]["reads"]
    assert reads[2:] == ddp[2:], f"host reads per step {reads}, where ddp makes {ddp}"
