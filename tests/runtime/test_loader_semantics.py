"""gpukit's loader iterates exactly as the DataLoader it wraps: passes, peeks, breaks, the
random stream, attributes, samplers, and exact resume."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    Sampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import gpukit as gk
from gpukit.runtime.data.loader import DeviceLoader

CPU = torch.device("cpu")
DATA = TensorDataset(torch.arange(20))


class _Steps:
    """Stands in for the run's backward count: a training loop bumps it once per batch."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


def _habits(loader: Any, steps: _Steps) -> list[Any]:
    """A loop with common habits: a peek for the batch size, dropout-like draws per batch, an
    epoch left early, and `len(loader)`. Returns what it saw and the random state at the end."""
    seen: list[Any] = [len(next(iter(loader))[0]), len(loader)]
    for epoch in range(3):
        for i, (x,) in enumerate(loader):
            seen.append(x.tolist())
            seen.append(torch.rand(2).tolist())  # the model's own draws (dropout)
            steps.count += 1
            if epoch == 1 and i == 2:
                break
    seen.append(torch.get_rng_state())
    return seen


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("generator", [False, True])
def test_a_program_sees_the_batches_and_random_numbers_of_the_plain_dataloader(
    shuffle: bool, generator: bool
) -> None:
    def run(wrap: bool) -> list[Any]:
        torch.manual_seed(3)
        g = torch.Generator().manual_seed(9) if generator else None
        plain = DataLoader(DATA, batch_size=3, shuffle=shuffle, generator=g)
        steps = _Steps()
        loader = DeviceLoader(plain, CPU, 1, 0, seed=0, steps=steps) if wrap else plain
        return _habits(loader, steps)

    assert _same(run(wrap=True), run(wrap=False))


def test_a_peek_does_not_consume_the_epoch_and_a_break_does_not_leak() -> None:
    steps = _Steps()
    loader = DeviceLoader(DataLoader(DATA, batch_size=4), CPU, 1, 0, seed=0, steps=steps)
    assert next(iter(loader))[0].tolist() == [0, 1, 2, 3]  # the DDP tutorial's batch-size peek
    assert loader.epoch == 0 and loader.position == 0
    assert [b[0][0].item() for b in loader] == [0, 4, 8, 12, 16]  # all 5 batches
    for (x,) in loader:  # an epoch left after two training steps
        steps.count += 1
        if x[0] == 4:
            break
    assert loader.epoch == 1 and loader.position == 2  # a save now would continue that pass
    assert [b[0][0].item() for b in loader] == [0, 4, 8, 12, 16]  # the next pass is whole
    assert loader.epoch == 3


def test_every_iter_is_its_own_pass() -> None:
    loader = DeviceLoader(DataLoader(DATA, batch_size=10), CPU, 1, 0, seed=0)
    pairs = [(a[0][0].item(), b[0][0].item()) for a, b in zip(loader, loader, strict=True)]
    assert pairs == [(0, 0), (10, 10)]
    assert loader.epoch == 2


def test_it_has_the_dataloader_attributes() -> None:
    def collate(items: list[Any]) -> Any:
        return torch.utils.data.default_collate(items)

    plain = DataLoader(DATA, batch_size=6, drop_last=True, collate_fn=collate, timeout=7)
    loader = gk.Runtime(devices="cpu").setup_loader(plain)
    assert len(loader) == 3 and loader.dataset is DATA and len(loader.dataset) == 20
    assert loader.batch_size == 6 and loader.drop_last and loader.num_workers == 0
    assert loader.collate_fn is collate and loader.timeout == 7
    assert isinstance(loader.sampler, SequentialSampler)
    with pytest.raises(AttributeError):
        _ = loader.no_such_attribute


def test_exact_resume_redoes_the_pass_start_and_keeps_the_random_stream() -> None:
    """Two batches, a "checkpoint" (position, the pass's start state, the RNG state), then a
    fresh loader resumed from it sees the rest of the epoch and the same random numbers."""

    def fresh(steps: _Steps) -> DeviceLoader:
        return DeviceLoader(
            DataLoader(DATA, batch_size=3, shuffle=True), CPU, 1, 0, seed=0, steps=steps
        )

    torch.manual_seed(11)
    steps = _Steps()
    whole = []
    for (x,) in fresh(steps):
        whole.append((x.tolist(), torch.rand(1).item()))
        steps.count += 1
    after = torch.get_rng_state()

    torch.manual_seed(11)
    steps = _Steps()
    first = fresh(steps)
    batches = iter(first)
    for _ in range(2):
        next(batches)
        torch.rand(1)
        steps.count += 1
    saved = (first.epoch, first.position, first.pass_rng(), torch.get_rng_state())
    del batches

    torch.manual_seed(999)  # whatever the resumed process did before loading
    resumed = fresh(_Steps())
    resumed.resume(saved[0], saved[1], saved[2])
    torch.set_rng_state(saved[3])
    assert next(iter(resumed))[0].tolist() == whole[2][0]  # a peek after loading...
    torch.set_rng_state(saved[3])  # (undo the peek's own draws, which a plain peek makes too)
    rest = [(x.tolist(), torch.rand(1).item()) for (x,) in resumed]  # ...keeps the resume
    assert rest == whole[2:] and torch.equal(torch.get_rng_state(), after)
    assert resumed.epoch == 1


def test_a_users_distributed_sampler_is_kept_and_its_epoch_set() -> None:
    samplers = [DistributedSampler(DATA, num_replicas=2, rank=r, seed=5) for r in range(2)]
    loaders = [
        DeviceLoader(DataLoader(DATA, batch_size=2, sampler=s), CPU, 2, r, seed=0)
        for r, s in enumerate(samplers)
    ]
    assert all(lo.sampler is s for lo, s in zip(loaders, samplers, strict=True))
    for epoch in range(2):
        got = [[i for (b,) in lo for i in b.tolist()] for lo in loaders]
        expected = []
        for r in range(2):
            reference = DistributedSampler(DATA, num_replicas=2, rank=r, seed=5)
            reference.set_epoch(epoch)
            expected.append(list(reference))
        assert got == expected
    assert samplers[0].epoch == 1


def test_a_program_that_calls_set_epoch_keeps_its_numbering() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, seed=5)
    loader = DeviceLoader(DataLoader(DATA, batch_size=5, sampler=sampler), CPU, 2, 0, seed=0)
    for epoch in (10, 11):
        sampler.set_epoch(epoch)
        reference = DistributedSampler(DATA, num_replicas=2, rank=0, seed=5)
        reference.set_epoch(epoch)
        assert [i for (b,) in loader for i in b.tolist()] == list(reference)
        assert sampler.epoch == epoch


def test_a_sampler_for_another_rank_is_refused_with_a_fix_to_follow() -> None:
    sampler = DistributedSampler(DATA, num_replicas=4, rank=3)
    with pytest.raises(gk.ConfigError, match=r"rank 3 of 4.*num_replicas=rt.world_size"):
        DeviceLoader(DataLoader(DATA, sampler=sampler), CPU, 2, 0, seed=0)


def test_custom_samplers_and_batch_samplers_are_sharded_by_stride() -> None:
    weights = torch.ones(20)

    def shard(rank: int, **options: Any) -> list[int]:
        torch.manual_seed(0)  # every rank draws the same list, as Runtime(seed=...) makes it
        loader = DeviceLoader(DataLoader(DATA, **options), CPU, 2, rank, seed=0)
        return [i for (b,) in loader for i in b.tolist()]

    weighted = {"sampler": WeightedRandomSampler(weights, 20), "batch_size": 4}
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()  # a DataLoader pass draws its base seed first
    drawn = list(WeightedRandomSampler(weights, 20))
    assert [shard(r, **weighted) for r in range(2)] == [drawn[0::2], drawn[1::2]]
    by_batch = {"batch_sampler": BatchSampler(SequentialSampler(DATA), 3, drop_last=False)}
    # 7 batches padded to 8: rank 1 gets batch 0 again, like DistributedSampler's padding
    assert shard(0, **by_batch) == [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19]
    assert shard(1, **by_batch) == [3, 4, 5, 9, 10, 11, 15, 16, 17, 0, 1, 2]


class _Endless(Sampler[int]):
    def __iter__(self) -> Iterator[int]:
        while True:
            yield 0


def test_a_sampler_without_a_length_is_refused_on_several_ranks() -> None:
    with pytest.raises(gk.ConfigError, match=r"_Endless over 2 ranks: it has no length"):
        DeviceLoader(DataLoader(DATA, sampler=_Endless()), CPU, 2, 0, seed=0)
    # In one process it is the user's loop's business, as with plain PyTorch.
    loader = DeviceLoader(DataLoader(DATA, sampler=_Endless(), batch_size=2), CPU, 1, 0, 0)
    assert next(iter(loader))[0].tolist() == [0, 0]
