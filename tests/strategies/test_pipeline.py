"""Pipeline parallel under ``gk.strategies.Parallel(pp=...)``, for real on gloo processes:
the gpt workload's model (its head tied to its token embedding, on the first and the last
stage) and a plain stack of blocks train as the one-process program does.

Bit for bit where the arithmetic allows it: with one micro-batch (GPipe) every stage computes
what the whole model computes, and the tied weight's gradient is the sum of its two parts in
either order (one addition of two numbers). Cut into micro-batches, the gradient is a mean of
the micro-batches' gradients instead of one over the batch (a different rounding): those runs
are compared in float64 to 1e-10, absolute and relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.workloads.gpt import GPT, GPTConfig, SequenceCrossEntropy
from tests.fsdp_models import assert_bit_identical

pytestmark = [pytest.mark.processes, pytest.mark.xdist_group("pipeline")]

STEPS, BATCH, VOCAB = 10, 8, 11
CLOSE = {"rtol": 1e-10, "atol": 1e-10}


def _gpt(layers: int = 2, double: bool = False) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, context=8, n_layer=layers, n_head=2, d_model=16))
    return model.double() if double else model


class Block(nn.Module):
    """A residual MLP block: the plain stack's repeated unit."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _stack(double: bool = True) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(*(Block() for _ in range(4)))
    return model.double() if double else model


def _batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        return [
            (
                torch.randint(0, VOCAB, (BATCH, 8), generator=g),
                torch.randint(0, VOCAB, (BATCH, 8), generator=g),
            )
            for _ in range(STEPS)
        ]
    return [
        (torch.randn(BATCH, 8, generator=g).double(), torch.randn(BATCH, 8, generator=g).double())
        for _ in range(STEPS)
    ]


def _train(rt: gk.Runtime, kind: str, steps: int = STEPS, manual: bool = True) -> dict[str, Any]:
    """``steps`` AdamW steps on the same batches on every rank; the losses, the whole model's
    weights after them (rank 0's), and the outputs of an evaluation."""
    if kind == "stack":
        model = _stack()
    else:  # "gpt" in float32, "gpt64" in float64, "gpt4": 4 blocks in float64
        model = _gpt(layers=4 if kind == "gpt4" else 2, double=kind != "gpt")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = rt.setup(model, opt)
    loss_fn = SequenceCrossEntropy() if kind.startswith("gpt") else nn.MSELoss()
    criterion = rt.setup_criterion(loss_fn)
    losses = []
    for x, y in _batches("gpt" if kind.startswith("gpt") else "stack")[:steps]:
        x, y = x.to(rt.device), y.to(rt.device)
        if manual:
            loss = criterion(model(x), y)
            rt.backward(loss)
            rt.step(opt)
        else:
            loss = rt.train_step(opt, (x, y), lambda b: criterion(model(b[0]), b[1]))
        rt.log(loss=loss)
        losses.append(loss.detach().clone())
    model.eval()
    with torch.no_grad():
        out = model(x)
    gathered = rt.gather_for_metrics(out)
    return {
        "losses": torch.stack(losses),
        "history": [h["loss"] for h in rt.history],
        "weights": rt.full_state_dict(),
        "eval": out,
        "gathered": gathered.shape,
        "every_rank_loss": rt.all_gather(losses[-1].reshape(1)).flatten(),
    }


def _reference(kind: str, **settings: Any) -> dict[str, Any]:
    return _train(gk.Runtime(devices="cpu", seed=0, **settings), kind)


def _pp(**options: Any) -> gk.strategies.Parallel:
    return gk.strategies.Parallel(dp_shard=options.pop("dp_shard", 1), pp=2, **options)


# -- fidelity ---------------------------------------------------------------------------------
def test_gpt_over_two_stages_is_the_one_process_run_bit_for_bit() -> None:
    rt = gk.Runtime(strategy=_pp(pp_schedule="GPipe", pp_microbatches=1), devices=["cpu"] * 2)
    got, want = rt.launch(_train, "gpt"), _reference("gpt")
    assert torch.equal(got["losses"], want["losses"])
    assert_bit_identical(got["weights"], want["weights"])  # the tied head included
    assert torch.equal(got["weights"]["head.weight"], got["weights"]["token_embedding.weight"])
    assert torch.equal(got["eval"], want["eval"])
    assert torch.equal(got["every_rank_loss"], got["losses"][-1].repeat(2))
    assert got["history"] == want["history"]


@pytest.mark.slow
def test_gpt_in_micro_batches_with_1f1b_matches_in_float64() -> None:
    rt = gk.Runtime(strategy=_pp(), devices=["cpu"] * 2, log_every=5)
    got, want = rt.launch(_train, "gpt64"), _reference("gpt64", log_every=5)
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)
    assert got["gathered"] == want["gathered"]
    # Averaged over the ranks in float64, one process's average stays in its sums' float32.
    assert got["history"] == pytest.approx(want["history"], rel=1e-6)


@pytest.mark.slow
def test_a_plain_stack_cut_where_the_user_says_with_accumulation_and_clipping() -> None:
    settings = {"accumulate": 2, "clip": 0.05}
    strategy = _pp(pp_split=["3"], pp_microbatches=2)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 2, **settings)  # type: ignore[arg-type]
    got, want = rt.launch(_train, "stack"), _reference("stack", **settings)
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


def _train_step(rt: gk.Runtime) -> dict[str, Any]:
    return _train(rt, "stack", manual=False)


@pytest.mark.slow
def test_train_step_cuts_micro_batches_as_one_process_does() -> None:
    rt = gk.Runtime(strategy=_pp(), devices=["cpu"] * 2, accumulate=2)
    got = rt.launch(_train_step)
    want = _train_step(gk.Runtime(devices="cpu", seed=0, accumulate=2))
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


@pytest.mark.slow
def test_two_stages_times_two_shards_match_one_process() -> None:
    rt = gk.Runtime(strategy=_pp(dp_shard=2), devices=["cpu"] * 4)
    # Every rank reads the whole batch: the data-parallel ranks' mean gradient is the one
    # process's (the same gradient twice, halved).
    got = rt.launch(_train, "gpt64", 4)
    want = _train(gk.Runtime(devices="cpu", seed=0), "gpt64", 4)
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


SCHEDULE_CASES = [
    ("GPipe", None),
    ("1F1B", None),
    ("Interleaved1F1B", None),
    ("LoopedBFS", None),
    ("InterleavedZeroBubble", None),
    ("ZBVZeroBubble", None),
]


def _two_steps(rt: gk.Runtime) -> dict[str, Any]:
    return _train(rt, "gpt4", 2)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "per_rank"), SCHEDULE_CASES)
def test_every_schedule_trains_the_tied_model_as_one_process(
    schedule: str, per_rank: int | None
) -> None:
    strategy = _pp(pp_schedule=schedule, pp_stages_per_rank=per_rank, pp_microbatches=4)
    got = gk.Runtime(strategy=strategy, devices=["cpu"] * 2).launch(_two_steps)
    want = _two_steps(gk.Runtime(devices="cpu", seed=0))
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


# -- checkpoints across layouts ----------------------------------------------------------------
def _save(rt: gk.Runtime, folder: str) -> dict[str, Any]:
    out = _train(rt, "stack", 3)
    rt.save(folder)
    return out


def _load(rt: gk.Runtime, folder: str) -> dict[str, torch.Tensor]:
    model = _stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = rt.setup(model, opt)
    rt.load(folder)
    return rt.full_state_dict()


@pytest.mark.slow
def test_a_checkpoint_moves_between_two_stages_and_one(tmp_path: Path) -> None:
    staged = gk.strategies.Parallel(dp_shard=1, pp=2)
    flat = gk.strategies.Parallel(dp_shard=2)
    saved = gk.Runtime(strategy=staged, devices=["cpu"] * 2).launch(_save, str(tmp_path / "a"))
    loaded = gk.Runtime(strategy=flat, devices=["cpu"] * 2).launch(_load, str(tmp_path / "a"))
    assert_bit_identical(loaded, saved["weights"])
    flat_saved = gk.Runtime(strategy=flat, devices=["cpu"] * 2).launch(_save, str(tmp_path / "b"))
    back = gk.Runtime(strategy=staged, devices=["cpu"] * 2).launch(_load, str(tmp_path / "b"))
    assert_bit_identical(back, flat_saved["weights"])


# -- refusals ------------------------------------------------------------------------------------
def _mistakes(rt: gk.Runtime) -> list[str]:
    """What each misuse raises, in order (every rank the same)."""
    said = []
    model = rt.setup(_stack())
    x = torch.randn(BATCH, 8).double()
    try:
        torch.nn.functional.mse_loss(model(x), x)
    except ConfigError as err:
        said.append(str(err))
    criterion = rt.setup_criterion(nn.MSELoss())
    try:
        criterion(model(x[:3]), x[:3])
    except ConfigError as err:
        said.append(str(err))
    return said


def test_misuses_of_the_pipeline_are_clear_errors() -> None:
    said = gk.Runtime(strategy=_pp(), devices=["cpu"] * 2).launch(_mistakes)
    assert "rt.setup_criterion" in said[0]
    assert "got a batch of 3" in said[1] and "multiple of 2" in said[1]


def _setup_only(rt: gk.Runtime) -> None:
    rt.setup(_stack())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"pp_schedule": "1F1B", "pp_microbatches": 1}, "pp_microbatches"),
        ({"pp_split": ["9"]}, "has no entry 9"),
        ({"pp_split": ["1", "2"]}, "make 3 stage(s)"),
    ],
)
def test_a_pipeline_that_cannot_be_built_is_refused(options: dict[str, Any], said: str) -> None:
    rt = gk.Runtime(strategy=_pp(**options), devices=["cpu"] * 2)
    with pytest.raises(Exception, match="pp") as caught:
        rt.launch(_setup_only)
    assert said in str(caught.value)


# -- what a step costs -------------------------------------------------------------------------
def _counted(rt: gk.Runtime) -> dict[str, Any]:
    """Reads (gk.trace) and the collectives the pipeline adds, over 4 steps after 2."""
    from gpukit.strategies import pipeline

    calls: dict[str, int] = {"broadcast": 0, "all_reduce": 0}

    class Counting:
        def __getattr__(self, name: str) -> Any:
            found = getattr(torch.distributed, name)
            if name not in calls:
                return found

            def counted(*args: Any, **kwargs: Any) -> Any:
                calls[name] += 1
                return found(*args, **kwargs)

            return counted

    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = rt.setup(model, opt)
    criterion = rt.setup_criterion(SequenceCrossEntropy())
    batches = _batches("gpt")
    for x, y in batches[:2]:
        rt.train_step(opt, (x, y), lambda b: criterion(model(b[0]), b[1]))
    rt.flush_logs()
    real, pipeline.dist = pipeline.dist, Counting()  # type: ignore[assignment]
    try:
        with gk.trace() as t:
            for x, y in batches[2:6]:
                rt.log(loss=rt.train_step(opt, (x, y), lambda b: criterion(model(b[0]), b[1])))
    finally:
        pipeline.dist = real
    return {"reads": sum(s.count for s in t.syncs), **calls}


def test_a_step_adds_one_loss_broadcast_and_one_tied_sum() -> None:
    rt = gk.Runtime(strategy=_pp(), devices=["cpu"] * 2, log_every=2)
    counts = rt.launch(_counted)
    # Per step: the loss from the last stage, the tied weight's gradients summed; the only
    # reads are the two flushes of the logged loss (log_every=2 over 4 steps).
    assert counts == {"reads": 2, "broadcast": 4, "all_reduce": 4}


@pytest.mark.slow
def test_bf16_mixed_runs_each_stage_under_autocast_as_the_whole_model() -> None:
    strategy = _pp(pp_schedule="GPipe", pp_microbatches=1)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 2, precision="bf16-mixed")
    got = rt.launch(_train, "gpt", 3)
    want = _train(gk.Runtime(devices="cpu", seed=0, precision="bf16-mixed"), "gpt", 3)
    assert torch.equal(got["losses"], want["losses"])
    assert_bit_identical(got["weights"], want["weights"])


@pytest.mark.slow
def test_two_stages_times_tensor_parallel_match_one_process() -> None:
    # gpukit train --workload gpt --devices 4 --tp 2 --pp 2, on the small model: each stage
    # split by the plan read off the model, the tied head's copies summed across the stages.
    rt = gk.Runtime(strategy=_pp(tp=2), devices=["cpu"] * 4)
    got, want = rt.launch(_train, "gpt64", 4), _train(gk.Runtime(devices="cpu", seed=0), "gpt64", 4)
    torch.testing.assert_close(got["losses"], want["losses"], **CLOSE)
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


def _skipping(rt: gk.Runtime) -> dict[str, Any]:
    """The plain stack with a NaN target at step 3, under nonfinite="skip"."""
    model = _stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = rt.setup(model, opt)
    criterion = rt.setup_criterion(nn.MSELoss())
    for step, (x, y) in enumerate(_batches("stack")[:5]):
        if step == 2:
            y = torch.full_like(y, float("nan"))
        rt.backward(criterion(model(x), y))
        rt.step(opt)
    return {
        "weights": rt.full_state_dict(),
        "skipped": rt.all_gather(torch.tensor([rt.skipped_steps()])),
    }


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_on_every_stage_alike() -> None:
    rt = gk.Runtime(strategy=_pp(), devices=["cpu"] * 2, nonfinite="skip")
    got = rt.launch(_skipping)
    want = _skipping(gk.Runtime(devices="cpu", seed=0, nonfinite="skip"))
    assert got["skipped"].flatten().tolist() == [1, 1]
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)


def _checkpointed(rt: gk.Runtime) -> dict[str, Any]:
    out = _train(rt, "gpt64", 3)
    out["groups"] = [g.name for g in rt.strategy.plans[-1].groups]  # type: ignore[attr-defined]
    return out


@pytest.mark.slow
def test_a_stage_of_one_block_still_shards_and_checkpoints_it_as_a_block() -> None:
    strategy = _pp(activation_checkpointing="full")
    got = gk.Runtime(strategy=strategy, devices=["cpu"] * 2).launch(_checkpointed)
    want = _train(gk.Runtime(devices="cpu", seed=0), "gpt64", 3)
    assert got["groups"][0] == "blocks.0"  # rank 0's stage: its block, then the root
    for name, value in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], value, **CLOSE)
