"""Sharded checkpoints under fsdp, for real on gloo processes (float64): a run saved and
resumed, on the same or another number of ranks, ends with exactly the weights of a run that
was never interrupted; the exported weights load into a plain model; damaged or mismatched
checkpoints are refused and change nothing.

Resuming on another number of ranks keeps the arithmetic: with 2 ranks each gradient is
(g0 + g1) / 2, which one rank accumulating two micro-batches computes exactly as g0/2 + g1/2
(halving is exact), so the weights are compared bit for bit there too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_model
from torch import nn

import gpukit as gk
from tests.fsdp_models import VOCAB, TiedLM, assert_bit_identical

# One worker runs the module: its results are made once, by a module-scoped fixture.
pytestmark = pytest.mark.xdist_group("fsdp-checkpoint")

BATCH = 8  # samples per optimizer step, over all ranks and micro-batches


def _model(vocab: int = VOCAB) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TiedLM(vocab, depth=2).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _train(
    rt: gk.Runtime, folder: str, stop: int, save_at: int | None, resume: bool
) -> dict[str, Any]:
    """Train to step ``stop`` (saving at ``save_at``), each rank on its share of every batch
    and each micro-batch of it in turn; returns the full weights and what the save wrote."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = rt.setup(model, optimizer)
    if resume:
        rt.load(folder)
    accumulate = rt.config.accumulate
    out: dict[str, Any] = {"resumed_at": rt.global_step}
    while rt.global_step < stop:
        x, y = _batch(rt.global_step)
        n = BATCH // (rt.world_size * accumulate)
        for a in range(accumulate):
            k = rt.rank * accumulate + a
            logits = model(x[k * n : (k + 1) * n])
            rt.backward(F.cross_entropy(logits.flatten(0, 1), y[k * n : (k + 1) * n].flatten()))
            rt.step(optimizer)
        if rt.global_step == save_at:
            out["saved"] = str(rt.save(folder))
            out["full"] = rt.full_state_dict()
            out["full_sizes"] = rt.all_gather(len(out["full"])).tolist()
            out["at_save"] = _full(model)
    out["weights"] = _full(model)
    return out


def _runtime(ranks: int, accumulate: int = 1, **kwargs: Any) -> gk.Runtime:
    return gk.Runtime(
        strategy="fsdp", devices=["cpu"] * ranks, seed=0, accumulate=accumulate, **kwargs
    )


@pytest.fixture(autouse=True)
def no_process_group_left() -> Any:
    """One-rank runs join a process group in the test process: none may outlive its test
    (a later launch forks from this process)."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks: 3 steps, a save, 3 more steps."""
    folder = tmp_path_factory.mktemp("fsdp-ckpt") / "ck"
    run = _runtime(2).launch(_train, str(folder), 6, 3, False)
    run["folder"] = folder
    return run


@pytest.mark.processes
def test_resumed_on_two_ranks_equals_the_uninterrupted_run(saved: dict[str, Any]) -> None:
    resumed = _runtime(2).launch(_train, str(saved["folder"]), 6, None, True)
    assert resumed["resumed_at"] == 3
    assert_bit_identical(saved["weights"], resumed["weights"])
    # The optimizer state came back too: without it AdamW's next steps would differ.
    assert not torch.equal(saved["weights"]["emb.weight"], saved["at_save"]["emb.weight"])


@pytest.mark.processes
def test_resumed_on_one_rank_equals_the_uninterrupted_two_rank_run(tmp_path: Path) -> None:
    # Saved after step 2: the micro-step count (2) is a whole window of 2 micro-batches.
    straight = _runtime(2).launch(_train, str(tmp_path / "ck"), 4, 2, False)
    with pytest.warns(UserWarning, match=r"written by 2 rank\(s\), this run has 1"):
        resumed = _runtime(1, accumulate=2).launch(_train, str(tmp_path / "ck"), 4, None, True)
    assert resumed["resumed_at"] == 2
    assert_bit_identical(straight["weights"], resumed["weights"])


@pytest.mark.processes
@pytest.mark.slow
def test_resumed_on_four_ranks_continues_the_two_rank_run(saved: dict[str, Any]) -> None:
    resumed = _runtime(4).launch(_train, str(saved["folder"]), 6, None, True)
    assert resumed["resumed_at"] == 3
    # Four ranks sum four gradients where two summed two: the same up to rounding.
    for name, value in saved["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=1e-10, atol=1e-12)


@pytest.mark.processes
def test_the_exported_weights_load_into_a_plain_model(saved: dict[str, Any]) -> None:
    plain = _model()
    load_model(plain, str(Path(saved["saved"]) / "model.safetensors"))
    full = saved["full"]
    assert saved["full_sizes"] == [len(full), 0]  # rank 1 gets {}
    assert set(full) == set(plain.state_dict())
    for name, value in plain.state_dict().items():
        assert full[name].device.type == "cpu" and not hasattr(full[name], "full_tensor")
        assert torch.equal(value, full[name]), name
        assert torch.equal(value, saved["at_save"][name]), name
    assert plain.head.weight is plain.emb.weight


@pytest.mark.processes
def test_the_manifest_lists_every_ranks_shards(saved: dict[str, Any]) -> None:
    folder = Path(saved["saved"])
    listed = set(json.loads((folder / "manifest.json").read_text())["files"])
    on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert listed == on_disk - {"manifest.json"}
    shards = sorted(n for n in listed if n.startswith("sharded/") and n.endswith(".distcp"))
    assert len(shards) == 2, listed
    assert {"model.safetensors", "state.pt", "sharded/.metadata"} <= listed


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    folder = tmp_path / "ck"
    shutil.copytree(saved["folder"], folder)
    return folder


def _one_rank(folder: Path, model: nn.Module) -> tuple[gk.Runtime, nn.Module, Any]:
    rt = _runtime(1)
    built = model
    optimizer = torch.optim.AdamW(built.parameters(), lr=1e-2)
    built, optimizer = rt.setup(built, optimizer)
    return rt, built, optimizer


@pytest.mark.processes
def test_a_damaged_shard_is_refused_and_nothing_changes(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    folder = _copy(saved, tmp_path)
    step = Path(saved["saved"]).name
    shard = sorted((folder / step / "sharded").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rt, model, optimizer = _one_rank(folder, _model())
    before = _full(model)
    with pytest.raises(gk.ConfigError, match=rf"{shard.name} does not match the checksum"):
        rt.load(folder / step)
    assert_bit_identical(before, _full(model))
    assert not optimizer.state and rt.global_step == 0
    rt.teardown()


@pytest.mark.processes
def test_a_model_of_another_shape_is_refused_and_nothing_changes(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    rt, model, optimizer = _one_rank(saved["folder"], _model(vocab=VOCAB + 1))
    before = _full(model)
    with pytest.raises(gk.ConfigError, match=r"does not fit.*emb.weight: checkpoint \(67, 16\)"):
        rt.load(saved["folder"])
    assert_bit_identical(before, _full(model))
    assert not optimizer.state and rt.global_step == 0  # reading its layout left no state
    rt.teardown()


@pytest.mark.processes
def test_a_checkpoint_without_fsdp_is_refused_by_fsdp_and_the_other_way(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    plain = gk.Runtime(devices="cpu", seed=0)
    model = _model()
    model, _ = plain.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(gk.ConfigError, match=r"written by a sharded \(fsdp\) run.*strategy='fsdp'"):
        plain.load(saved["folder"])
    plain.save(tmp_path / "plain")
    rt, model, _ = _one_rank(tmp_path, _model())
    with pytest.raises(gk.ConfigError, match=r"did not shard its model.*Nothing was changed"):
        rt.load(tmp_path / "plain")
    rt.teardown()


def test_nan_in_the_weights_marks_the_checkpoint_bad(tmp_path: Path) -> None:
    rt, model, _ = _one_rank(tmp_path, _model())
    with torch.no_grad():
        model.blocks[0][0].bias.to_local()[0] = float("nan")
    with pytest.warns(UserWarning, match=r"non-finite values.*blocks.0.0.bias has 1 NaN"):
        path = rt.save(tmp_path / "ck")
    assert json.loads((path / "manifest.json").read_text())["finite"] is False
    assert not (tmp_path / "ck" / "latest").exists()
    rt.teardown()


def test_full_state_dict_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(gk.ConfigError, match=r"exactly one model set up.*setup saw 0"):
        rt.full_state_dict()
    with pytest.raises(gk.ConfigError, match=r"rt.full_state_dict got .*SGD.*pass the model"):
        rt.full_state_dict(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(gk.ConfigError, match=r"rt.full_state_dict got 'model'.*pass the model"):
        rt.full_state_dict("model")  # type: ignore[arg-type]
    model = rt.setup(nn.Linear(2, 1))
    full = rt.full_state_dict()
    assert set(full) == {"weight", "bias"} and torch.equal(full["weight"], model.weight)


def _save_before_training(rt: gk.Runtime, folder: str, stop: int, resume: bool) -> Any:
    """A save (or a resume from it) before the first step, then ``stop`` steps."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = rt.setup(model, optimizer)
    if resume:
        rt.load(folder)
    else:
        rt.save(folder)
    stateless = not optimizer.state
    n = BATCH // rt.world_size
    while rt.global_step < stop:
        x, y = _batch(rt.global_step)
        logits = model(x[rt.rank * n : (rt.rank + 1) * n])
        rt.backward(
            F.cross_entropy(logits.flatten(0, 1), y[rt.rank * n : (rt.rank + 1) * n].flatten())
        )
        rt.step(optimizer)
    return {"weights": _full(model), "stateless": stateless}


@pytest.mark.processes
def test_a_save_before_the_first_step_changes_nothing(tmp_path: Path) -> None:
    # Laying out a fresh optimizer's state for the shards steps it once at learning rate 0
    # (AdamW's step count 1): neither the run that saved nor one resumed from it may keep that.
    straight = _runtime(2).launch(_train, str(tmp_path / "none"), 3, None, False)
    saving = _runtime(2).launch(_save_before_training, str(tmp_path / "ck"), 3, False)
    resumed = _runtime(2).launch(_save_before_training, str(tmp_path / "ck"), 3, True)
    assert saving["stateless"] and resumed["stateless"]
    assert_bit_identical(straight["weights"], saving["weights"])
    assert_bit_identical(straight["weights"], resumed["weights"])


def _snapshot_then_step(rt: gk.Runtime) -> dict[str, bool]:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    snapshot = rt.full_state_dict()
    kept = {k: v.clone() for k, v in snapshot.items()}
    rt.backward(model(torch.ones(2, 4)).sum())
    rt.step(optimizer)
    after = rt.full_state_dict()
    return {
        k: torch.equal(snapshot[k], kept[k]) and not torch.equal(after[k], kept[k]) for k in kept
    }


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_full_state_dict_is_a_snapshot_that_training_leaves_alone(strategy: str) -> None:
    # On the CPU, moving to the CPU (and one rank's gather) returns the live tensors: the
    # weights handed back are copied, as they are on a GPU.
    rt = gk.Runtime(strategy=strategy, devices=["cpu"], seed=0)
    try:
        kept = rt.launch(_snapshot_then_step) if strategy == "fsdp" else _snapshot_then_step(rt)
    finally:
        rt.teardown()
    assert kept == dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], True)
