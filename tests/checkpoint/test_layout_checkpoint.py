"""A run saved under one mesh layout resumes under another (4 gloo processes, float64): DCP
reshards every weight and optimizer state, so the model right after the load is bit for bit
the one saved, and the resumed steps train on from it.

2 replicas x 2 shards -> 4 shards, and 2 shards x tensor parallel 2 -> 4 shards without tensor
parallel. The steps after the load are compared with the uninterrupted run to rounding: the
new layout sums the data-parallel gradients in another grouping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gpukit as gk
from tests.fsdp_models import assert_bit_identical
from tests.strategies import test_fsdp_layouts as layouts

pytestmark = [pytest.mark.slow, pytest.mark.processes]


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in state.items()
    }


def _train(rt: gk.Runtime, folder: str, stop: int, save_at: int | None) -> dict[str, Any]:
    """Train to step ``stop`` from ``folder``'s checkpoint if ``save_at`` is None, else from
    the start, saving there at ``save_at``; the full weights when loaded, saved and at the end."""
    model = layouts._model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=layouts.LR)
    model, optimizer = rt.setup(model, optimizer)
    out: dict[str, Any] = {}
    if save_at is None:
        rt.load(folder)
        out["loaded"] = _full(rt.unwrap(model))
        out["loaded_step"] = rt.global_step
    shards, shard = rt.strategy.sampler_placement()
    while rt.global_step < stop:
        x, y = layouts._piece(rt.global_step, shard, shards)
        rt.backward(F.mse_loss(model(x), y))
        rt.step(optimizer)
        if rt.global_step == save_at:
            rt.save(folder)
            out["saved"] = _full(rt.unwrap(model))
    out["final"] = _full(rt.unwrap(model))
    return out


def _run(parallel: dict[str, Any], *args: Any) -> dict[str, Any]:
    rt = gk.Runtime(parallel=parallel, devices=["cpu"] * 4, seed=0)
    return rt.launch(_train, *args)  # type: ignore[no-any-return]


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"dp_replicate": 2, "dp_shard": 2}, {"dp_shard": 4}),
        ({"dp_shard": 2, "tp": 2, "tp_plan": "plan"}, {"dp_shard": 4}),
        ({"dp_shard": 4}, {"dp_shard": 2, "tp": 2, "tp_plan": "plan"}),
    ],
    ids=["2x2-to-4x1", "tp2-to-none", "none-to-tp2"],
)
def test_a_run_saved_under_one_layout_resumes_under_another(
    before: dict[str, Any], after: dict[str, Any], tmp_path: Path
) -> None:
    before = {k: _plan() if v == "plan" else v for k, v in before.items()}
    after = {k: _plan() if v == "plan" else v for k, v in after.items()}
    folder = str(tmp_path / "ck")
    first = _run(before, folder, 2, 2)
    resumed = _run(after, folder, 4, None)
    assert resumed["loaded_step"] == 2
    assert_bit_identical(first["saved"], resumed["loaded"])
    straight = _run(after, str(tmp_path / "straight"), 4, 99)
    for k, v in straight["final"].items():  # trained on: the same steps, to rounding
        torch.testing.assert_close(resumed["final"][k], v, rtol=1e-12, atol=1e-14)
