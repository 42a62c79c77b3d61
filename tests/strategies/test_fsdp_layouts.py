"""fsdp over 4 gloo processes: HSDP (2 replicas x 2 shards) and fsdp x tensor parallel (2 x 2),
each compared (float64) with a plain one-process program: HSDP bit for bit, fsdp x tensor
parallel to a few units in the last place (see its test for why).

The reference computes each data-parallel rank's gradient of its piece of the batch and
combines them as the 4-rank run does: HSDP divides each gradient by 2 before reduce-scattering
within a replica group, then by 2 again while all-reducing across the groups (torch splits the
division by 4 so; each halving is exact), so the result is ((g0/2 + g1/2)/2 + (g2/2 + g3/2)/2)
in the grouping of the mesh. Under tensor parallelism the two tp ranks of a pair read the same
samples (``FSDP.sampler_placement``), so 2 data-parallel ranks remain.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from tests.fsdp_models import assert_bit_identical
from tests.strategies import test_fsdp_fidelity as fidelity

# One worker runs the module: the launches several tests read are made once, by fixtures.
pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.xdist_group("fsdp-layouts")]

WIDTH, DEPTH, BATCH, LR = 8, 2, 8, 1e-2


class Blocks(nn.Module):
    """Residual Linear-ReLU-Linear blocks (the first Linear split by columns under tensor
    parallelism, the second by rows), then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))
            for _ in range(DEPTH)
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Blocks().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def _piece(step: int, shard: int, shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _batch(step)
    n = BATCH // shards
    return x[shard * n : (shard + 1) * n], y[shard * n : (shard + 1) * n]


def _train(rt: gk.Runtime, steps: int) -> dict[str, torch.Tensor]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = rt.setup(model, optimizer)
    shards, shard = rt.strategy.sampler_placement()
    for step in range(steps):
        x, y = _piece(step, shard, shards)
        rt.backward(F.mse_loss(model(x), y))
        rt.step(optimizer)
    state = rt.unwrap(model).state_dict()
    return {k: v.full_tensor().detach().clone() for k, v in state.items()}  # type: ignore[operator]


def _reference(steps: int, ranks: int, clip: float | None = None) -> dict[str, torch.Tensor]:
    """``ranks`` data-parallel ranks in pairs: each pair reduced first, then the pairs;
    ``clip``: torch's clip_grad_norm_ over the combined gradients."""
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)
    for step in range(steps):
        grads = [
            torch.autograd.grad(F.mse_loss(model(x), y), params)
            for x, y in (_piece(step, r, ranks) for r in range(ranks))
        ]
        if ranks == 4:
            pairs = [
                [a / 2 + b / 2 for a, b in zip(grads[i], grads[i + 1], strict=True)] for i in (0, 2)
            ]
            total = [a / 2 + b / 2 for a, b in zip(*pairs, strict=True)]
        else:
            total = [a / 2 + b / 2 for a, b in zip(*grads, strict=True)]
        for p, g in zip(params, total, strict=True):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hsdp(accumulate: int) -> dict[str, object]:
    """3 steps of HSDP (2 replicas x 2 shards), each rank's piece in ``accumulate``
    micro-batches, with its all-reduces counted (``_train_accumulating``)."""
    strategy = gk.strategies.FSDP(replicas=2)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4, seed=0, accumulate=accumulate)
    return rt.launch(_train_accumulating, 3)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def hsdp_once() -> dict[str, object]:
    """The HSDP run without accumulation: checked against the plain program, and the count of
    all-reduces an accumulating run must match."""
    return _hsdp(accumulate=1)


def test_hsdp_two_replicas_of_two_shards_equals_one_process(hsdp_once: dict[str, object]) -> None:
    got = hsdp_once["state"]
    assert isinstance(got, dict)
    assert_bit_identical(got, _reference(3, ranks=4))


def test_fsdp_times_tensor_parallel_equals_one_process() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}
    rt = gk.Runtime(strategy=gk.strategies.FSDP(tp=2, tp_plan=plan), devices=["cpu"] * 4, seed=0)
    got, want = rt.launch(_train, 3), _reference(3, ranks=2)
    # Not bit-identical, and no plain program can be without redoing tensor parallelism: the
    # row-split Linear adds two half-width matrix products (and its input gradient the
    # column-split one's), a sum one process's single product rounds differently (measured:
    # a few 1e-17 after 3 steps). The tolerance is a few units in the last place.
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-13, atol=1e-15)


@pytest.fixture(scope="module")
def two() -> dict[str, Any]:
    """2 steps of the tied model over 2 ranks with bf16 gathering, and with compiled blocks,
    made in one launch (``test_fsdp_fidelity``'s, which also says what each run's Runtime
    took)."""
    torch.manual_seed(0)
    compiled = {"compile": "blocks", "activation_checkpointing": "selective"}
    return fidelity._launch(
        {
            "bf16": ({"mixed": "bf16"}, fidelity._train, ("tied", 2)),
            "compiled": (compiled, fidelity._train, ("tied", 2)),
        }
    )


def test_compiled_blocks_train_as_the_plain_program_does(two: dict[str, Any]) -> None:
    # torch.compile fuses the blocks' element-wise work, so the last bits may move: the same
    # result to float64 rounding, every block compiled, and the model's names unchanged.
    got = two["compiled"]
    assert got["took"]["options"].activation_checkpointing == "selective"
    want = fidelity._reference("tied", 2, ranks=2, accumulate=1)
    assert got["state"].keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-10, atol=1e-12)
    assert "compile: blocks" in got["printed"]


def test_bf16_gathering_trains_close_to_float32(two: dict[str, Any]) -> None:
    # MixedPrecisionPolicy(bf16, reduce fp32): weights gathered in bfloat16, so the result
    # moves by bfloat16's rounding, not more; the sharded weights themselves stay float32.
    got = two["bf16"]
    assert got["took"]["options"].mixed == "bf16"
    want = fidelity._reference("tied", 2, ranks=2, accumulate=1)
    worst = max((got["state"][k] - want[k]).abs().max().item() for k in want)
    assert 0 < worst < 0.05
    assert all(v.dtype == want[k].dtype for k, v in got["state"].items())


def _train_accumulating(rt: gk.Runtime, steps: int) -> dict[str, object]:
    """As ``_train`` with each rank's piece cut into ``rt.accumulate`` micro-batches; also
    counts the all-reduces (across replicas) the steps make."""
    import torch.distributed as dist

    calls = [0]
    original = dist.all_reduce

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = rt.setup(model, optimizer)
    shards, shard = rt.strategy.sampler_placement()
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for step in range(steps):
            x, y = _piece(step, shard, shards)
            for xm, ym in zip(x.chunk(rt.accumulate), y.chunk(rt.accumulate), strict=True):
                rt.backward(F.mse_loss(model(xm), ym))
                rt.step(optimizer)
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    state = rt.unwrap(model).state_dict()
    full = {k: v.full_tensor().detach().clone() for k, v in state.items()}  # type: ignore[operator]
    return {"state": full, "all_reduces": calls[0]}


def test_hsdp_accumulation_all_reduces_across_replicas_only_on_the_last_micro_batch(
    hsdp_once: dict[str, object],
) -> None:
    twice = _hsdp(accumulate=2)
    # As many all-reduces per optimizer step with two micro-batches as with one.
    assert hsdp_once["all_reduces"] == twice["all_reduces"] > 0
    want = _reference(3, ranks=4)
    got = twice["state"]
    assert isinstance(got, dict) and got.keys() == want.keys()
    for k in want:  # the micro-batches' gradients are summed before the replicas' average
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)


def test_fsdp_times_tensor_parallel_clips_by_the_norm_over_both_meshes() -> None:
    # The split layers' gradients live on the 2-D mesh, the head's on the data-parallel one:
    # torch's clip_grad_norm_ refuses to stack them; the norm is completed per mesh instead.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}
    strategy = gk.strategies.FSDP(tp=2, tp_plan=plan)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4, seed=0, clip=0.05, nonfinite="raise")
    got, want = rt.launch(_train, 3), _reference(3, ranks=2, clip=0.05)
    unclipped = _reference(3, ranks=2)
    assert any(not torch.allclose(want[k], unclipped[k]) for k in want)  # clipping bit
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-14)
