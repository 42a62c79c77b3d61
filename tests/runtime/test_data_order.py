"""Accelerate's data order (``data_order="accelerate"``) in one process, ranks played by
``DeviceLoader``'s shard arguments: the batches each rank takes, the one draw from the global
generator at set-up, a resumed pass, the padding ``rt.gather_for_metrics`` leaves out, and
every bad input refused. Real ranks against real Accelerate: tests/runtime/test_anchor_programs.py.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

import gpukit as gk
from gpukit.cli._settings import add_setting_flags, values
from gpukit.errors import ConfigError
from gpukit.runtime.data.dealing import DataOrder, Dealt
from gpukit.runtime.data.loader import DeviceLoader
from gpukit.runtime.data.padding import describe, trailing_padding

CPU = torch.device("cpu")
ACCELERATE = DataOrder("accelerate")


def _loader(n: int = 45, batch: int = 4, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, **kwargs)


def _indices(loader: Any) -> list[list[int]]:
    return [b[0].tolist() for b in loader]


def test_whole_batches_are_dealt_as_accelerates_batch_sampler_shard_deals_them() -> None:
    shard = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    for n in (1, 5, 9, 12, 13, 23):
        for size in (1, 2, 4):
            for drop_last in (False, True):
                batches = BatchSampler(SequentialSampler(range(n)), size, drop_last)
                for ranks in (2, 3):
                    for even in (True, False):
                        for split in (False, True) if size % ranks == 0 else (False,):
                            for r in range(ranks):
                                ours = Dealt(batches, ranks, r, even, split)
                                theirs = shard(batches, ranks, r, split, even)
                                assert list(ours) == list(theirs)
                                assert len(ours) == len(theirs)


@pytest.mark.parametrize("sampler", ["shuffle", "distributed"])
def test_passes_and_random_draws_are_accelerates_prepared_loaders(sampler: str) -> None:
    """Accelerate's own prepare_data_loader, told the rank and the rank count (no process
    group: no generator sync, which equal seeds make a no-op), against gpukit's loader: the
    same batches over 3 passes, and the global generator left in the same state."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    state = pytest.importorskip("accelerate.state")
    data = TensorDataset(torch.arange(23))

    def given() -> DataLoader[Any]:
        if sampler == "shuffle":
            return DataLoader(data, batch_size=3, shuffle=True)
        inner = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
        return DataLoader(data, batch_size=3, sampler=inner)

    try:
        for rank in range(2):
            torch.manual_seed(0)
            theirs = accelerate.prepare_data_loader(given(), num_processes=2, process_index=rank)
            expected = [_indices(theirs) for _ in range(3)]
            expected_rng = torch.get_rng_state()
            torch.manual_seed(0)
            ours = DeviceLoader(given(), CPU, 2, rank, order=ACCELERATE)
            assert [_indices(ours) for _ in range(3)] == expected
            assert torch.equal(torch.get_rng_state(), expected_rng)
    finally:
        state.PartialState._reset_state()


class _Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample read draws from the global generator, as a random augmentation does."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, index: int) -> torch.Tensor:
        return index + torch.rand(())


@pytest.mark.parametrize("ranks", [1, 2])
def test_batches_are_read_one_ahead_as_accelerates_loader_reads_them(ranks: int) -> None:
    """Between two batches the step draws (dropout): the draws of the samples read come
    before or after it as under Accelerate, so both give the same numbers."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    state = pytest.importorskip("accelerate.state")

    def run(loader: Any) -> list[torch.Tensor]:
        seen = []
        for batch in loader:
            seen += [batch, torch.rand(2)]  # the step's own draw
        return seen

    try:
        for rank in range(ranks):
            torch.manual_seed(0)
            given = DataLoader(_Augmented(), batch_size=3, shuffle=True)
            theirs = run(accelerate.prepare_data_loader(given, None, ranks, rank))
            torch.manual_seed(0)
            given = DataLoader(_Augmented(), batch_size=3, shuffle=True)
            ours = run(DeviceLoader(given, CPU, ranks, rank, order=ACCELERATE))
            assert len(ours) == len(theirs) and all(map(torch.equal, ours, theirs))
    finally:
        state.PartialState._reset_state()


def test_dealt_batches_pad_the_last_round_from_the_start_of_the_pass() -> None:
    ranks = [_indices(DeviceLoader(_loader(10, 3), CPU, 2, r, order=ACCELERATE)) for r in range(2)]
    assert ranks == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    uneven = DataOrder("accelerate", even_batches=False)
    assert _indices(DeviceLoader(_loader(10, 3), CPU, 2, 1, order=uneven)) == [[3, 4, 5], [9]]
    split = DataOrder("accelerate", split_batches=True)
    assert _indices(DeviceLoader(_loader(10, 4), CPU, 2, 1, order=split)) == [
        [2, 3],
        [6, 7],
        [0, 1],
    ]


def test_a_shuffled_loader_gets_a_generator_from_one_draw_at_setup() -> None:
    torch.manual_seed(5)
    expected_seed = int(torch.empty((), dtype=torch.int64).random_().item())
    after_one_draw = torch.get_rng_state()
    torch.manual_seed(5)
    given = _loader(shuffle=True)
    loaders = [DeviceLoader(given, CPU, 2, r, order=ACCELERATE) for r in range(2)]
    # Both "ranks" here share one process: the second drew nothing, the sampler had its
    # generator already.
    assert torch.equal(torch.get_rng_state(), after_one_draw)
    assert given.sampler.generator.initial_seed() == expected_seed % 2**64
    assert loaders[1].sampler.generator is given.sampler.generator
    ranks = []
    for rank in range(2):  # each rank from its own process's same draw
        torch.manual_seed(5)
        ranks.append(_indices(DeviceLoader(_loader(shuffle=True), CPU, 2, rank, order=ACCELERATE)))
    every = [i for batches in ranks for b in batches for i in b]
    assert sorted(set(every)) == list(range(45)) and len(every) == 48  # 3 samples twice


def test_one_process_keeps_the_loader_and_draws_nothing_at_setup() -> None:
    given = _loader(shuffle=True)
    before = torch.get_rng_state()
    loader = DeviceLoader(given, CPU, 1, 0, order=ACCELERATE)
    assert torch.equal(torch.get_rng_state(), before)
    assert given.sampler.generator is None and loader.sampler is given.sampler


def test_a_resumed_pass_continues_with_the_next_batch_on_every_rank() -> None:
    for rank in range(2):
        torch.manual_seed(0)
        straight = DeviceLoader(_loader(shuffle=True), CPU, 2, rank, order=ACCELERATE)
        first = _indices(straight)
        it = iter(straight)
        second = [next(it)[0].tolist() for _ in range(2)]
        epoch, position, rng = straight.epoch, straight.position, straight.pass_rng()
        second += [b[0].tolist() for b in it]
        torch.manual_seed(0)
        resumed = DeviceLoader(_loader(shuffle=True), CPU, 2, rank, order=ACCELERATE)
        torch.manual_seed(123)  # the global state a checkpoint restores: not the pass's
        resumed.resume(epoch, position, rng)
        assert _indices(resumed) == second[2:] and first != second


def test_a_distributed_sampler_inside_is_dealt_and_told_each_epoch_as_under_accelerate() -> None:
    data = TensorDataset(torch.arange(12))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = DeviceLoader(
        DataLoader(data, batch_size=2, sampler=sampler), CPU, 2, 0, order=ACCELERATE
    )
    passes = [_indices(loader) for _ in range(2)]
    assert sampler.epoch == 1 and passes[0] != passes[1] and len(passes[0]) == 3


def test_padding_of_dealt_batches_is_counted_once() -> None:
    pads = [
        trailing_padding(DeviceLoader(_loader(45, 4), CPU, 2, r, order=ACCELERATE).sampler)
        for r in range(2)
    ]
    assert pads == [0, 3]  # 12 batches of 45 samples dealt to 2 ranks: the last 3 repeat
    uneven = DataOrder("accelerate", even_batches=False)
    assert trailing_padding(DeviceLoader(_loader(45, 4), CPU, 2, 1, order=uneven).sampler) == 0


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("batch", [2, 4, 8])
def test_the_samples_left_after_padding_are_each_sample_once(split: bool, batch: int) -> None:
    """What ``rt.gather_for_metrics`` keeps of every rank's batches (``padding.describe``)."""
    order = DataOrder("accelerate", split_batches=split)
    kept: list[int] = []
    for rank in range(2):
        torch.manual_seed(0)
        loader = DeviceLoader(_loader(45, batch, shuffle=True), CPU, 2, rank, order=order)
        for position, (batch_rows,) in enumerate(loader, start=1):
            rows = describe(loader, position, (batch_rows,), None)
            kept += batch_rows[: len(batch_rows) - rows.padding].tolist()
    assert sorted(kept) == list(range(45))


@pytest.mark.parametrize(
    ("keywords", "says"),
    [
        ({"data_order": "jax"}, "data_order='jax': use 'torch'"),
        ({"data_order": None}, "data_order=None: use 'torch'"),
        ({"data_order": "accelerate", "even_batches": "yes"}, "even_batches='yes': use True"),
        ({"data_order": "accelerate", "split_batches": 1}, "split_batches=1: use True"),
        ({"even_batches": False}, "even_batches=False with data_order='torch'"),
        ({"split_batches": True}, "split_batches=True with data_order='torch'"),
        (
            {"even_batches": True, "split_batches": False},
            "even_batches=True and split_batches=False with data_order='torch'",
        ),
    ],
)
def test_bad_data_order_settings_are_refused(keywords: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(says)):
        gk.Runtime(devices="cpu", **keywords)


def test_split_batches_refuses_a_batch_size_that_does_not_divide_by_the_ranks() -> None:
    split = DataOrder("accelerate", split_batches=True)
    with pytest.raises(ConfigError, match="batch size is 3: use a batch_size that divides by 2"):
        DeviceLoader(_loader(10, 3), CPU, 2, 0, order=split)


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


def test_an_iterable_dataset_on_several_ranks_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"reads an IterableDataset.*data_order='torch'"):
        DeviceLoader(DataLoader(_Stream(), batch_size=2), CPU, 2, 0, order=ACCELERATE)
    # One process: nothing to deal, the loader is kept.
    assert len(_indices(DeviceLoader(DataLoader(_Stream(), batch_size=2), CPU, 1, 0))) == 4


def test_gpukit_train_flags_and_config_keys_give_the_data_order() -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    given = values(parser.parse_args(["--data-order", "accelerate", "--split-batches", "on"]))
    assert (given["data_order"], given["even_batches"], given["split_batches"]) == (
        "accelerate",
        None,
        True,
    )
    gk.Runtime(devices="cpu", **{k: given[k] for k in ("data_order", "split_batches")})
    assert values(parser.parse_args([]))["data_order"] == "torch"


class _Epochs(torch.utils.data.Dataset[torch.Tensor]):
    """A dataset with ``set_epoch`` (as Hugging Face's have): each sample says the epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, self.epoch])


@pytest.mark.parametrize("sampler", ["sequential", "distributed"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_dataset_is_told_each_epoch_as_accelerates_prepared_loader_tells_it(
    ranks: int, sampler: str
) -> None:
    """Accelerate tells the dataset unless, on several ranks, the sampler inside is told
    instead (a DistributedSampler); in one process it tells both."""
    accelerate = pytest.importorskip("accelerate.data_loader")
    state = pytest.importorskip("accelerate.state")

    def given() -> DataLoader[Any]:
        data = _Epochs()
        if sampler == "sequential":
            return DataLoader(data, batch_size=2)
        inner = DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
        return DataLoader(data, batch_size=2, sampler=inner)

    def passes(loader: Any) -> list[list[list[int]]]:
        return [[b.tolist() for b in loader] for _ in range(3)]

    try:
        for rank in range(ranks):
            theirs = passes(accelerate.prepare_data_loader(given(), None, ranks, rank))
            ours = passes(DeviceLoader(given(), CPU, ranks, rank, order=ACCELERATE))
            assert ours == theirs
            told = sampler == "sequential" or ranks == 1
            assert {row[1] for b in ours[2] for row in b} == {2 if told else 0}
    finally:
        state.PartialState._reset_state()


def test_one_process_in_accelerates_order_tells_the_dataset_each_epoch() -> None:
    rt = gk.Runtime(devices="cpu", data_order="accelerate")
    loader = rt.setup(DataLoader(_Epochs(), batch_size=4))
    assert [[b[:, 1].tolist() for b in loader] for _ in range(3)] == [
        [[0] * 4] * 2,
        [[1] * 4] * 2,
        [[2] * 4] * 2,
    ]
    plain = gk.Runtime(devices="cpu").setup(DataLoader(_Epochs(), batch_size=4))
    assert {row[1] for _ in range(2) for b in plain for row in b.tolist()} == {0}


class _TensorBatches:
    """A batch sampler that yields tensors of indices, not lists."""

    batch_size, drop_last = 4, False

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        for batch in BatchSampler(SequentialSampler(range(10)), 4, drop_last=False):
            yield torch.tensor(batch)


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("split", [False, True])
def test_a_batch_sampler_yielding_tensors_is_refused_on_every_rank(split: bool, even: bool) -> None:
    for rank in range(2):
        order = DataOrder("accelerate", even_batches=even, split_batches=split)
        loader = DataLoader(TensorDataset(torch.arange(10)), batch_sampler=_TensorBatches())
        dealt = DeviceLoader(loader, CPU, 2, rank, order=order)
        with pytest.raises(ConfigError, match=r"yielded tensor\(shape=\(4,\).* as batch 0 .*lists"):
            next(iter(dealt))
