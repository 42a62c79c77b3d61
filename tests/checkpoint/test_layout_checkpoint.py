"""A run saved under one mesh layout resumes under another (4 gloo processes, float64): DCP
reshards every weight and optimizer state, so the model right after the load is bit for bit
the one saved, and the resumed steps train on from it.

2 replicas x 2 shards -> 4 shards, and 2 shards x tensor parallel 2 -> 4 shards without tensor
parallel. All the cases run in one launch of the 4 processes, each layout a Runtime of its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gpukit as gk
from tests.fsdp_models import assert_bit_identical
from tests.strategies import test_fsdp_layouts as layouts

# One worker runs the module: its launch is made once, by a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.processes, pytest.mark.xdist_group("layout-checkpoint")]


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


def _train_in(parallel: dict[str, Any], *args: Any) -> dict[str, Any]:
    """``_train`` under a Runtime of ``parallel``'s layout, in the processes already running."""
    inner = gk.Runtime(parallel=parallel, devices="cpu", seed=0)
    try:
        return _train(inner, *args)
    finally:
        inner.teardown()


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}


# Saved under the first layout, resumed under the second.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "2x2-to-4x1": ({"dp_replicate": 2, "dp_shard": 2}, {"dp_shard": 4}),
    "tp2-to-none": ({"dp_shard": 2, "tp": 2, "tp_plan": "plan"}, {"dp_shard": 4}),
    "none-to-tp2": ({"dp_shard": 4}, {"dp_shard": 2, "tp": 2, "tp_plan": "plan"}),
}


def _every_case(rt: gk.Runtime, root: str) -> dict[str, Any]:
    out = {}
    for name, pair in CASES.items():
        before, after = ({k: _plan() if v == "plan" else v for k, v in d.items()} for d in pair)
        folder = f"{root}/{name}"
        first = _train_in(before, folder, 2, 2)
        resumed = _train_in(after, folder, 4, None)
        out[name] = {"saved": first["saved"], **resumed}
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case in one launch of 4 processes, each layout a Runtime of its own."""
    root = tmp_path_factory.mktemp("layouts")
    return gk.Runtime(strategy="ddp", devices=["cpu"] * 4).launch(_every_case, str(root))  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(CASES))
def test_a_run_saved_under_one_layout_resumes_under_another(
    name: str, resumed: dict[str, Any]
) -> None:
    got = resumed[name]
    assert got["loaded_step"] == 2
    assert_bit_identical(got["saved"], got["loaded"])
    # It trains on from there: two more steps moved every weight.
    assert all(not torch.equal(got["final"][k], v) for k, v in got["loaded"].items())
