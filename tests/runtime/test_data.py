"""The device loader: shards, epochs, positions, and what it refuses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset

import gpukit as gk
from gpukit.runtime.data.loader import DeviceLoader

CPU = torch.device("cpu")


def _indices(loader: DeviceLoader) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def test_ranks_see_disjoint_shards_that_cover_the_data_and_reshuffle_each_epoch() -> None:
    data = TensorDataset(torch.arange(20))
    shards = [
        DeviceLoader(DataLoader(data, batch_size=3, shuffle=True), CPU, 2, r, seed=7)
        for r in range(2)
    ]
    epochs = []
    for _ in range(3):
        seen = [_indices(s) for s in shards]
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(20))
        epochs.append(seen[0])
    assert epochs[0] != epochs[1] != epochs[2]
    assert all(s.epoch == 3 and s.position == 0 for s in shards)


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_shuffle_split_over_ranks_gives_the_ddp_recipes_and_lightnings_batches(
    drop_last: bool,
) -> None:
    """11 samples in twos over 2 ranks: the sampler pads the list to 12 and the loader's own
    drop_last drops a short last batch, as a DistributedSampler a program builds itself (its
    drop_last left False, PyTorch's DDP recipe) and Lightning Fabric's give: 3 batches a rank
    with drop_last, not 2."""
    from torch.utils.data import DistributedSampler

    data = TensorDataset(torch.arange(11))
    for rank in range(2):
        ours = DeviceLoader(
            DataLoader(data, batch_size=2, shuffle=True, drop_last=drop_last), CPU, 2, rank, seed=3
        )
        recipe = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=True, seed=3)
        theirs = DataLoader(data, batch_size=2, sampler=recipe, drop_last=drop_last)
        for epoch in range(2):
            recipe.set_epoch(epoch)
            expected = [batch.tolist() for (batch,) in theirs]
            assert [batch.tolist() for (batch,) in ours] == expected
            assert len(expected) == 3


def test_no_shuffle_keeps_order_and_drop_last_is_kept() -> None:
    data = TensorDataset(torch.arange(10))
    loader = DeviceLoader(DataLoader(data, batch_size=4, drop_last=True), CPU, 1, 0, seed=0)
    assert [b[0].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_position_continues_where_an_interrupted_pass_stopped() -> None:
    data = TensorDataset(torch.arange(12))
    full = DeviceLoader(DataLoader(data, batch_size=2), CPU, 1, 0, seed=1)
    expected = [b[0].tolist() for b in full]
    resumed = DeviceLoader(DataLoader(data, batch_size=2), CPU, 1, 0, seed=1)
    resumed.position = 4
    assert [b[0].tolist() for b in resumed] == expected[4:]
    assert len(expected) == 6 and resumed.epoch == 1


def test_batches_arrive_on_the_device_with_structure() -> None:
    rt = gk.Runtime(devices="cpu")
    data = [{"x": torch.ones(2), "y": 1} for _ in range(4)]
    loader = rt.setup_loader(DataLoader(data, batch_size=2))
    batch = next(iter(loader))
    assert batch["x"].shape == (2, 2) and batch["y"].tolist() == [1, 1]


class _Evens(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(0, self.n, 2))

    def __len__(self) -> int:
        return (self.n + 1) // 2


def test_custom_sampler_is_kept_on_one_rank_and_strided_on_several() -> None:
    data = TensorDataset(torch.arange(12))
    kept = DeviceLoader(DataLoader(data, sampler=_Evens(12), batch_size=3), CPU, 1, 0, seed=0)
    assert _indices(kept) == [0, 2, 4, 6, 8, 10] and kept.sampler.__class__ is _Evens
    shards = [
        _indices(DeviceLoader(DataLoader(data, sampler=_Evens(12), batch_size=2), CPU, 2, r, 0))
        for r in range(2)
    ]
    assert shards == [[0, 4, 8], [2, 6, 10]]


def test_fewer_samples_than_ranks_is_refused() -> None:
    with pytest.raises(gk.ConfigError, match="1 samples, fewer than the 2 ranks"):
        DeviceLoader(DataLoader(TensorDataset(torch.arange(1))), CPU, 2, 0, seed=0)


class _Stream(IterableDataset[torch.Tensor]):
    """A stream without a length: only iterating it tells whether it is empty."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.zeros(2)])


class _DeclaredEmpty(_Stream):
    def __len__(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        (DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4), r"dataset is empty \(0"),
        (
            DataLoader(TensorDataset(torch.zeros(3, 2)), batch_size=4, drop_last=True),
            "dataset has 3 samples, fewer than batch_size=4, and drop_last=True drops them all",
        ),
        (DataLoader(TensorDataset(torch.zeros(3, 2)), batch_sampler=[]), "sampler yields no"),
        (DataLoader(_DeclaredEmpty(), batch_size=2), r"dataset is empty \(0"),
    ],
    ids=["empty-dataset", "drop-last", "empty-batch-sampler", "iterable-of-length-0"],
)
def test_a_loader_without_batches_is_refused_at_setup(loader: DataLoader, message: str) -> None:
    """A loop over it would run no step and end as if done."""
    rt = gk.Runtime(devices="cpu")
    with pytest.raises(
        gk.ConfigError, match="rt.setup got a DataLoader with no batches: its " + message
    ):
        rt.setup(torch.nn.Linear(2, 1), loader)


def test_a_stream_without_a_length_is_not_checked() -> None:
    rt = gk.Runtime(devices="cpu")
    _, loader = rt.setup(torch.nn.Linear(2, 1), DataLoader(_Stream(), batch_size=1))
    assert [b.shape for b in loader] == [torch.Size([1, 2])]


def _four_samples_in_threes(rt: gk.Runtime) -> int:
    data = DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=3, drop_last=True)
    _, loader = rt.setup(torch.nn.Linear(2, 1), data)
    return len(loader)


@pytest.mark.processes
def test_a_rank_left_without_batches_is_refused_under_several_processes() -> None:
    """One batch of 3 in one process; 2 samples a rank under 2 ranks: no batch left."""
    assert gk.Runtime(devices="cpu").launch(_four_samples_in_threes) == 1
    with pytest.raises(gk.ConfigError, match=r"split over 2 ranks, 4 samples \(1 batch in one"):
        gk.Runtime(devices=2).launch(_four_samples_in_threes)


@pytest.mark.gpu
def test_cuda_batches_are_prefetched_pinned_and_correct() -> None:
    data = TensorDataset(torch.arange(4096.0).reshape(64, 64))
    loader = DeviceLoader(DataLoader(data, batch_size=8), torch.device("cuda:0"), 1, 0, seed=0)
    assert loader.loader.pin_memory
    total = sum(float(b.sum()) for (b,) in loader)
    assert total == float(torch.arange(4096.0).sum())


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    extras: Mapping[str, torch.Tensor]


class _Frozen(Mapping[str, torch.Tensor]):
    def __init__(self, items: dict[str, torch.Tensor]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_every_tensor_copied_on_the_side_stream_is_recorded_on_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch copied on the side stream is used on the current one: the allocator must be
    told so for every tensor in it, or their memory could be reused while kernels read it.
    Dataclass and custom Mapping batches once went unrecorded."""
    import gpukit.runtime.data.prefetch as prefetch

    recorded: list[int] = []

    class Stream:
        device = torch.device("cuda:0")

        def wait_event(self, event: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    tensors = [torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)]
    for t in tensors:
        t.record_stream = lambda stream, t=t: recorded.append(id(t))  # type: ignore[method-assign]
    batch = [_Batch(tensors[0], _Frozen({"a": tensors[1], "b": tensors[2]})), "label"]
    assert prefetch._ready(batch, object(), Stream()) is batch  # type: ignore[arg-type]
    assert sorted(recorded) == sorted(id(t) for t in tensors)
