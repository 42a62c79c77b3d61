"""The one-mesh strategy (``gk.strategies.Parallel``): its layout checked before any process
starts, and over 4 gloo processes the same training as fsdp's layouts (HSDP, fsdp x tensor
parallel), compared with the plain one-process program of ``test_fsdp_layouts``."""

from __future__ import annotations

import pytest
import torch

import gpukit as gk
from gpukit.errors import ConfigError
from gpukit.strategies.layout import Layout
from tests.fsdp_models import assert_bit_identical
from tests.strategies import test_fsdp_layouts as layouts


def test_minus_one_takes_what_the_other_dimensions_leave() -> None:
    assert Layout(tp=2, pp=2).resolved(8).dp_shard == 2
    assert Layout(dp_shard=2, pp=-1).resolved(8).pp == 4
    assert Layout(dp_shard=4, tp=1).resolved(4) == Layout(dp_shard=4)


@pytest.mark.parametrize(
    ("sizes", "ranks", "said"),
    [
        ({"tp": 3}, 8, "multiply to 3, which does not divide 8"),
        ({"dp_shard": 2, "tp": 2}, 8, "multiply to 4, not 8"),
        ({"tp": 0}, 4, "tp=0: give a whole number"),
        ({"tp": 1.5}, 4, "tp=1.5"),
        ({"pp": -2}, 4, "pp=-2: give 1 or more"),
        ({"pp": -1, "dp_shard": -1}, 4, "pp and dp_shard are both -1"),
        ({"ep": 2}, 4, "unknown dimension(s) 'ep'"),
    ],
)
def test_a_bad_layout_is_one_error_before_any_process(
    sizes: dict[str, object], ranks: int, said: str
) -> None:
    with pytest.raises(ConfigError, match="parallel") as caught:
        Layout.of(sizes).resolved(ranks)
    assert said in str(caught.value)


def test_the_layout_is_checked_against_the_devices_given() -> None:
    with pytest.raises(ConfigError, match="multiply to 4, not 2"):
        gk.Runtime(strategy=gk.strategies.Parallel(dp_shard=2, tp=2), devices=["cpu"] * 2)


def test_tensor_and_replicas_take_a_size_not_minus_one() -> None:
    with pytest.raises(ConfigError, match="tp and dp_replicate take a size"):
        gk.strategies.Parallel(tp=-1, dp_shard=2)


def test_ranks_that_split_one_batch_read_the_same_samples() -> None:
    layout = Layout(dp_replicate=2, dp_shard=2, cp=2, tp=2).resolved(16)
    data = [layout.coordinates(r) for r in range(16)]
    assert [d["tp"] for d in data[:4]] == [0, 1, 0, 1]
    assert [d["cp"] for d in data[:4]] == [0, 0, 1, 1]
    assert data[15] == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}


@pytest.mark.slow
@pytest.mark.processes
def test_replicas_of_shards_on_one_mesh_equal_one_process() -> None:
    strategy = gk.strategies.Parallel(dp_replicate=2, dp_shard=2)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4, seed=0)
    assert_bit_identical(rt.launch(layouts._train, 3), layouts._reference(3, ranks=4))


@pytest.mark.slow
@pytest.mark.processes
def test_shards_times_tensor_parallel_on_one_mesh_equal_one_process() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"blocks.*.0": ColwiseParallel(), "blocks.*.2": RowwiseParallel()}
    strategy = gk.strategies.Parallel(dp_shard=-1, tp=2, tp_plan=plan)
    rt = gk.Runtime(strategy=strategy, devices=["cpu"] * 4, seed=0)
    got, want = rt.launch(layouts._train, 3), layouts._reference(3, ranks=2)
    for k in want:  # the row-split sums round differently (see test_fsdp_layouts)
        torch.testing.assert_close(got[k], want[k], rtol=1e-13, atol=1e-15)
