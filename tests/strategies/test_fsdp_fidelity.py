"""fsdp for real: 2 gloo processes (float64) compared bit for bit with a plain one-process
PyTorch program, written here without gpukit, that does the same arithmetic.

Why one process can match N ranks exactly: each rank's gradient of a micro-batch is computed on
the same numbers as in one process (the all-gathered weights are the full weights), fsdp divides
each rank's gradient by N before the reduce-scatter sums them (float64 risks no overflow, so
torch divides before summing), and dividing by a power of two is exact. With two ranks the sum
of two terms does not depend on the order. The reference therefore computes every rank's
micro-batch gradient with ``torch.autograd.grad`` and adds them in the order fsdp does: the
accumulation policy decides that order (see ``_combine``). AdamW then works element by element,
so the shards step exactly as the full tensors do.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.workloads import gpt
from tests.fsdp_models import VOCAB, TiedLM, assert_bit_identical

# One worker runs the module: the launches several tests read are made once, by fixtures.
pytestmark = pytest.mark.xdist_group("fsdp-fidelity")

LR = 1e-2
BATCH = 8  # samples per optimizer step, over all ranks and micro-batches


def _model(name: str) -> nn.Module:
    if name == "gpt":
        return gpt.build(seed=0).model.double()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TiedLM().double()


def _batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    if name == "gpt":
        data = _gpt_data()
        idx = torch.randint(0, len(data), (BATCH,), generator=g)
        xs, ys = zip(*(data[int(i)] for i in idx), strict=True)
        return torch.stack(xs), torch.stack(ys)
    tokens = torch.randint(0, VOCAB, (BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


_GPT_DATA: list[Any] = []


def _gpt_data() -> Any:
    if not _GPT_DATA:
        _GPT_DATA.append(gpt.build(seed=0).dataset)
    return _GPT_DATA[0]


def _piece(name: str, step: int, rank: int, k: int, ranks: int, accumulate: int) -> Any:
    """Rank ``rank``'s micro-batch ``k``: the global batch cut in ranks x accumulate pieces."""
    x, y = _batch(name, step)
    n = BATCH // (ranks * accumulate)
    at = (rank * accumulate + k) * n
    return x[at : at + n], y[at : at + n]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


def _train(rt: gk.Runtime, name: str, steps: int, fused: bool = False) -> dict[str, Any]:
    model = _model(name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=fused or None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model, optimizer = rt.setup(model, optimizer)  # the optimizer was built before setup
    a = rt.accumulate
    for step in range(steps):
        for k in range(a):
            x, y = _piece(name, step, rt.rank, k, rt.world_size, a)
            rt.backward(_loss(model, x, y))
            rt.step(optimizer)
    user = rt.unwrap(model)
    params = list(user.parameters())
    return {
        "state": {k: _full(v) for k, v in user.state_dict().items()},
        "local": sum(p.to_local().numel() for p in params),  # type: ignore[operator]
        "global": sum(p.numel() for p in params),
        "tied": isinstance(user, TiedLM) and user.head.weight is user.emb.weight,
        "printed": out.getvalue(),
        "skipped": rt._stepper.guard.skipped if rt._stepper.guard is not None else None,
    }


def _combine(grads: list[list[list[torch.Tensor]]], policy: str) -> list[torch.Tensor]:
    """grads[r][k]: rank r's gradients of micro-batch k (its loss already divided by the number
    of micro-batches), summed as fsdp sums them."""
    ranks = len(grads)
    if policy == "reduce-scatter":  # every micro-batch reduce-scatters into the sharded grad
        total: list[torch.Tensor] | None = None
        for k in range(len(grads[0])):
            reduced = [_sum([grads[r][k][i] / ranks for r in range(ranks)]) for i in _n(grads)]
            total = (
                reduced if total is None else [t + g for t, g in zip(total, reduced, strict=True)]
            )
        assert total is not None
        return total
    # no-sync: each rank accumulates its full gradient, one reduce-scatter at the end
    local = [_sum(grads[r][k] for k in range(len(grads[r]))) for r in range(ranks)]
    return [_sum([local[r][i] / ranks for r in range(ranks)]) for i in _n(grads)]


def _n(grads: list[list[list[torch.Tensor]]]) -> range:
    return range(len(grads[0][0]))


def _sum(values: Any) -> Any:
    values = list(values)
    if isinstance(values[0], list):  # lists of gradients: added element by element
        out = list(values[0])
        for more in values[1:]:
            out = [a + b for a, b in zip(out, more, strict=True)]
        return out
    out = values[0]
    for more in values[1:]:
        out = out + more
    return out


def _reference(
    name: str,
    steps: int,
    ranks: int,
    accumulate: int,
    policy: str = "reduce-scatter",
    clip: float | None = None,
    skip: set[int] = frozenset(),  # type: ignore[assignment]
    fused: bool = False,
) -> dict[str, torch.Tensor]:
    """The plain one-process program that does what ``ranks`` fsdp ranks do."""
    model = _model(name)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, fused=fused or None)
    for step in range(steps):
        if step in skip:
            continue
        grads = []
        for r in range(ranks):
            per_rank = []
            for k in range(accumulate):
                loss = _loss(model, *_piece(name, step, r, k, ranks, accumulate))
                if accumulate > 1:
                    loss = loss / accumulate
                per_rank.append(list(torch.autograd.grad(loss, params)))
            grads.append(per_rank)
        for p, g in zip(params, _combine(grads, policy), strict=True):
            p.grad = g
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fsdp(accumulate: int = 1, runtime: dict[str, Any] | None = None, **options: Any) -> gk.Runtime:
    strategy = gk.strategies.FSDP(**options)
    settings: dict[str, Any] = {"seed": 0, "accumulate": accumulate, **(runtime or {})}
    return gk.Runtime(strategy=strategy, devices=["cpu", "cpu"], **settings)


# A variant: the settings of ``_fsdp``, and the function its Runtime runs, with its arguments.
Variant = tuple[dict[str, Any], Any, tuple[Any, ...]]


def _in_turn(rt: gk.Runtime, variants: dict[str, Variant]) -> dict[str, Any]:
    """Each variant's result and the settings its Runtime took (the strategy's options, and
    the Runtime's that the variants vary), trained one after another in the ranks of one
    launch: the first on the Runtime rt.launch made (from its settings), each other one on a
    Runtime of its own in the same process group, as a script under `gpukit launch` makes
    it."""
    out = {}
    for i, (name, (settings, fn, args)) in enumerate(variants.items()):
        own = rt if i == 0 else _fsdp(**settings)
        try:
            varied = ("accumulate", "clip", "nonfinite", "log_every")
            took = {"options": own.strategy.options, **{k: getattr(own.config, k) for k in varied}}
            out[name] = {**fn(own, *args), "took": took}
        finally:
            if own is not rt:
                own.teardown()
    return out


def _launch(variants: dict[str, Variant]) -> dict[str, Any]:
    first, _, _ = next(iter(variants.values()))
    return _fsdp(**first).launch(_in_turn, variants)  # type: ignore[no-any-return]


RECOMPUTING = [
    {"activation_checkpointing": "full"},
    {"activation_checkpointing": "selective"},
    {"reshard": False},
]
POLICIES = ["reduce-scatter", "no-sync"]


@pytest.fixture(scope="module")
def trained() -> dict[str, Any]:
    """The runs the exact comparisons below check, made in one launch of 2 ranks."""
    variants: dict[str, Variant] = {
        "gpt": ({}, _train, ("gpt", 3)),
        "tied": ({}, _train, ("tied", 3)),
        "clip": ({"runtime": {"clip": 1.0}}, _train, ("tied", 3)),
    }
    for policy in POLICIES:
        variants[policy] = ({"accumulate": 2, "accumulation": policy}, _train, ("tied", 3))
    for i, options in enumerate(RECOMPUTING):
        variants[f"recompute-{i}"] = (options, _train, ("gpt", 2))
    return _launch(variants)


@pytest.mark.processes
def test_gpt_on_two_ranks_equals_one_process_with_an_optimizer_built_before_setup(
    trained: dict[str, Any],
) -> None:
    got = trained["gpt"]
    want = _reference("gpt", 3, ranks=2, accumulate=1)
    start = _model("gpt").state_dict()
    moved = max((want[k] - start[k]).abs().max().item() for k in want)
    assert moved > 1e-3  # it trained: an optimizer left on the old parameters moves nothing
    assert_bit_identical(got["state"], want)
    # Each rank keeps about half of every weight (the tied head counted once).
    assert got["global"] / 2 <= got["local"] <= got["global"] / 2 + 64 * 64
    printed = got["printed"]
    assert "fsdp over 2 rank(s)" in printed and "blocks.0" in printed and "per rank" in printed
    assert "(root: the rest)" in printed and "tied: " in printed


@pytest.mark.processes
def test_tied_head_with_an_uneven_vocabulary_stays_tied_and_exact(
    trained: dict[str, Any],
) -> None:
    got = trained["tied"]
    assert got["tied"]
    assert_bit_identical(got["state"], _reference("tied", 3, ranks=2, accumulate=1))
    assert "tied: emb.weight = head.weight" in got["printed"]


@pytest.mark.processes
@pytest.mark.parametrize("policy", POLICIES)
def test_accumulation_sums_in_the_order_of_its_policy(policy: str, trained: dict[str, Any]) -> None:
    got = trained[policy]
    # The variant's own settings took (its Runtime was made inside the launch).
    assert got["took"]["accumulate"] == 2
    assert got["took"]["options"] == gk.strategies.FSDP(accumulation=policy).options
    assert_bit_identical(got["state"], _reference("tied", 3, ranks=2, accumulate=2, policy=policy))


@pytest.mark.processes
@pytest.mark.parametrize("variant", range(len(RECOMPUTING)), ids=["full", "selective", "kept"])
def test_recomputing_and_keeping_gathered_weights_change_nothing(
    variant: int, trained: dict[str, Any]
) -> None:
    got = trained[f"recompute-{variant}"]
    # The variant's own settings took (its Runtime was made inside the launch).
    assert got["took"]["options"] == gk.strategies.FSDP(**RECOMPUTING[variant]).options
    assert_bit_identical(got["state"], _reference("gpt", 2, ranks=2, accumulate=1))


@pytest.mark.processes
def test_rank_zero_keeps_half_of_each_group(trained: dict[str, Any]) -> None:
    got = trained["tied"]
    # Shard(0) splits dim 0 as torch.chunk does: rank 0 keeps ceil(rows / 2) of each weight.
    model = _model("tied")
    want = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert got["local"] == want
    assert got["global"] == sum(p.numel() for p in model.parameters())
    printed = got["printed"]
    for name in ("blocks.0", "blocks.1", "blocks.2", "(root: the rest)", "total"):
        assert name in printed, printed


@pytest.mark.processes
def test_clipping_uses_the_global_norm_of_the_sharded_gradients(
    trained: dict[str, Any],
) -> None:
    got = trained["clip"]
    assert got["took"]["clip"] == 1.0  # the variant's own Runtime, made inside the launch
    want = _reference("tied", 3, ranks=2, accumulate=1, clip=1.0)
    unclipped = _reference("tied", 3, ranks=2, accumulate=1)
    # The total norm sums the squares shard by shard, then over the ranks: another order than
    # one process's, so its last bits may differ, and with them the clipped step's.
    for k in want:
        torch.testing.assert_close(got["state"][k], want[k], rtol=1e-12, atol=1e-12)
    # Clipping was on and mattered: a run of local norms (each rank's half) would differ too.
    assert any((want[k] - unclipped[k]).abs().max() > 1e-6 for k in want)


@pytest.mark.processes
def test_a_nan_on_one_rank_is_skipped_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUKIT_FAULT", "nan:1:2")
    rt = _fsdp(runtime={"nonfinite": "skip", "log_every": 1})
    got = rt.launch(_train_both, "tied", 3)
    assert got[0]["skipped"] == got[1]["skipped"] == 1
    for k in got[0]["state"]:
        assert torch.equal(got[0]["state"][k], got[1]["state"][k]), k
    # Skipping step 2 leaves the weights of step 1; step 3 then trains on: the reference is the
    # plain program that never took step 2 (AdamW's step count did not advance either), with
    # the same fused AdamW (its kernel rounds differently from the default one).
    want = _reference("tied", 3, ranks=2, accumulate=1, skip={1}, fused=True)
    assert_bit_identical(got[0]["state"], want)


def _train_both(rt: gk.Runtime, name: str, steps: int) -> list[dict[str, Any]]:
    mine = _train(rt, name, steps, fused=True)
    mine.pop("printed")
    both: list[Any] = [None, None]
    torch.distributed.all_gather_object(both, mine)
    return both


_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class _OomInBackward(torch.autograd.Function):
    """Runs out of memory in the backward of micro-batches over 4 samples: halfway through
    the model's backward, with the later blocks' gradients already reduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.samples = x.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.samples > 4:
            raise _OOM("CUDA out of memory. Tried to allocate 64.00 MiB (injected in a test)")
        return grad


class _OomLM(TiedLM):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for i, block in enumerate(self.blocks):
            h = h + block(_OomInBackward.apply(h) if i == 1 else h)
        return self.head(h)


def _oom_model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _OomLM().double()


def _recover(rt: gk.Runtime, steps: int) -> dict[str, Any]:
    model = _oom_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = rt.setup(model, optimizer)
    for step in range(steps):
        rt.train_step(optimizer, _batch("tied", step), lambda b: _loss(model, *b))
    state = {k: _full(v) for k, v in rt.unwrap(model).state_dict().items()}
    return {"state": state, "split": rt.oom_split, "events": len(rt.oom_events)}


def test_one_fsdp_rank_recovers_from_running_out_of_memory_in_the_backward() -> None:
    rt = gk.Runtime(strategy=gk.strategies.FSDP(), devices=["cpu"], seed=0, oom="recover")
    try:
        got = rt.launch(_recover, 3)
    finally:
        rt.teardown()
    assert got["split"] == 2 and got["events"] == 1
    # The uninterrupted plain program: every step as two micro-batches of 4, each loss
    # weighted by its half of the batch, the gradients added as the sharded ones accumulate.
    model = _oom_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)
    for step in range(3):
        x, y = _batch("tied", step)
        halves = [
            torch.autograd.grad(_loss(model, x[i : i + 4], y[i : i + 4]) * 0.5, params)
            for i in (0, 4)
        ]
        for p, a, b in zip(params, *halves, strict=True):
            p.grad = a + b
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert_bit_identical(got["state"], {k: v.detach() for k, v in model.state_dict().items()})


def test_recovering_from_out_of_memory_over_two_fsdp_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match="oom='recover' cannot be used with strategy 'fsdp'"):
        gk.Runtime(strategy="fsdp", devices=["cpu", "cpu"], oom="recover")


# Three logging windows: a read once per window, not once per step, shows as 3, not 12.
STEPS, LOG_EVERY = 12, 4


def _reads(rt: gk.Runtime, manual: bool) -> dict[str, Any]:
    model = _model("tied")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    model, optimizer = rt.setup(model, optimizer)
    batches = [_piece("tied", s, rt.rank, 0, rt.world_size, 1) for s in range(STEPS + 2)]

    def one(batch: Any) -> torch.Tensor:
        if not manual:
            return rt.train_step(optimizer, batch, lambda b: _loss(model, *b))
        loss = _loss(model, *batch)
        rt.backward(loss)
        rt.step(optimizer)
        return loss

    for batch in batches[:2]:  # first-step checks are one-time
        one(batch)
    rt.flush_logs()
    with gk.trace() as t:
        for batch in batches[2:]:
            rt.log(loss=one(batch))
    return {"reads": sum(s.count for s in t.syncs), "syncs": [(s.op, s.function) for s in t.syncs]}


STEADY: list[tuple[bool, dict[str, Any]]] = [
    (False, {}),
    (True, {}),
    (False, {"clip": 1.0}),
    (False, {"nonfinite": "skip"}),
]


@pytest.fixture(scope="module")
def steady() -> list[dict[str, Any]]:
    """What each of the STEADY variants read back, made in one launch of 2 ranks."""
    variants: dict[str, Variant] = {
        str(i): ({"runtime": {"log_every": LOG_EVERY, **runtime}}, _reads, (manual,))
        for i, (manual, runtime) in enumerate(STEADY)
    }
    return list(_launch(variants).values())


@pytest.mark.processes
@pytest.mark.parametrize(
    "variant", range(len(STEADY)), ids=["train_step", "manual", "clip", "nonfinite"]
)
def test_a_steady_fsdp_step_reads_nothing_back(variant: int, steady: list[dict[str, Any]]) -> None:
    _, runtime = STEADY[variant]
    found = steady[variant]
    # The variant's own settings took (its Runtime was made inside the launch).
    assert all(found["took"][k] == v for k, v in runtime.items())
    assert found["took"]["log_every"] == LOG_EVERY
    # The guard reads its counters back once per logging window, beside the metrics' flush.
    extra = STEPS // LOG_EVERY if "nonfinite" in runtime else 0
    assert found["reads"] == STEPS // LOG_EVERY + extra, found["syncs"]
