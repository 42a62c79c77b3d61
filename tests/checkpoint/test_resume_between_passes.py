"""A checkpoint saved between passes (``rt.save`` after an epoch) resumes the loaders' own
generators: a ``DataLoader(generator=...)``'s, a sampler's or a batch sampler's sampler's, and
the one Accelerate's order gives a shuffled loader at set-up. The resumed run takes the next
epochs in the order the uninterrupted run took them, and ends with the same weights, bit for
bit. A checkpoint written before these states were saved still loads; a damaged entry is
refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import gpukit as gk
from gpukit.checkpoint import files
from gpukit.errors import ConfigError

EPOCHS = 3


def _data(generator: str) -> DataLoader[Any]:
    """A shuffled loader whose generator is ``generator``: "none" (the global one), the
    "loader"'s, the "sampler"'s or the "batch_sampler"'s sampler's."""
    numbers = torch.arange(12.0)
    own = torch.Generator().manual_seed(7)
    if generator == "sampler":
        return DataLoader(numbers, batch_size=2, sampler=RandomSampler(numbers, generator=own))
    if generator == "batch_sampler":
        batches = BatchSampler(RandomSampler(numbers, generator=own), 2, drop_last=False)
        return DataLoader(numbers, batch_sampler=batches)
    given = own if generator == "loader" else None
    return DataLoader(numbers, batch_size=2, shuffle=True, generator=given)


def _epochs(rt: gk.Runtime, folder: Path, resume: bool, generator: str) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs, saving after the first; or, with ``resume``, load that save and
    train the rest. Writes this rank's batches and weights to ``folder`` and returns them."""
    torch.manual_seed(1234)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data(generator)
    model, optimizer, loader = rt.setup(model, optimizer, data)
    start = rt.load(folder / "ckpt")["epoch"] if resume else 0
    seen: dict[int, list[list[float]]] = {}
    for epoch in range(start, EPOCHS):
        seen[epoch] = []
        for x in loader:
            rt.backward(model(x[:, None]).sum())
            rt.step(optimizer)
            seen[epoch].append(x.tolist())
        if epoch == 0:
            rt.save(folder / "ckpt")
    ran = {"seen": seen, "weights": rt.unwrap(model).state_dict()}
    torch.save(ran, folder / f"{'resumed' if resume else 'straight'}-{rt.rank}.pt")
    return ran


def _same_from_epoch_one(folder: Path, ranks: int) -> None:
    for rank in range(ranks):
        straight = torch.load(folder / f"straight-{rank}.pt")
        resumed = torch.load(folder / f"resumed-{rank}.pt")
        assert sorted(resumed["seen"]) == [1, 2]
        assert resumed["seen"] == {e: straight["seen"][e] for e in (1, 2)}
        assert straight["seen"][1] != straight["seen"][0]  # each epoch its own order
        for name, tensor in straight["weights"].items():
            assert torch.equal(tensor, resumed["weights"][name]), name


@pytest.mark.parametrize("generator", ["loader", "sampler", "batch_sampler"])
@pytest.mark.parametrize("order", ["torch", "accelerate"])
def test_one_process_with_its_own_generator_resumes_the_next_epochs_order(
    tmp_path: Path, order: str, generator: str
) -> None:
    for resume in (False, True):
        rt = gk.Runtime(devices="cpu", data_order=order)  # type: ignore[arg-type]
        rt.launch(_epochs, tmp_path, resume, generator)
    _same_from_epoch_one(tmp_path, 1)


@pytest.mark.processes
def test_two_ranks_in_accelerates_order_resume_the_next_epochs_order(tmp_path: Path) -> None:
    for resume in (False, True):
        rt = gk.Runtime(devices=["cpu", "cpu"], data_order="accelerate")
        rt.launch(_epochs, tmp_path, resume, "none")
    _same_from_epoch_one(tmp_path, 2)


def _rewritten(tmp_path: Path, change: Any) -> Path:
    """The checkpoint of one epoch, its random states changed by ``change`` and its manifest
    written again, as an older or a damaged one would be."""
    _epochs(gk.Runtime(devices="cpu"), tmp_path, False, "loader")
    path = files.latest(tmp_path / "ckpt")
    state = torch.load(path / files.STATE, weights_only=True)
    for rank in state["rng"]:
        change(rank)
    torch.save(state, path / files.STATE)
    files.write_manifest(path, state["step"], [])
    return path


def _set_up_with_generator() -> tuple[gk.Runtime, torch.Generator]:
    rt = gk.Runtime(devices="cpu")
    own = torch.Generator().manual_seed(7)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = DataLoader(torch.arange(12.0), batch_size=2, shuffle=True, generator=own)
    rt.setup(model, optimizer, data)
    return rt, own


def test_a_checkpoint_without_generator_states_loads_and_leaves_them(tmp_path: Path) -> None:
    _rewritten(tmp_path, lambda rank: rank.pop("loader_generators"))
    rt, own = _set_up_with_generator()
    before = own.get_state()
    assert rt.load(tmp_path / "ckpt")["epoch"] == 1
    assert torch.equal(own.get_state(), before)


def test_a_checkpoint_whose_generator_states_are_not_states_is_refused(tmp_path: Path) -> None:
    _rewritten(tmp_path, lambda rank: rank.update(loader_generators=[["seven"]]))
    rt, own = _set_up_with_generator()
    before = own.get_state()
    with pytest.raises(ConfigError, match="its random states are not what gpukit writes"):
        rt.load(tmp_path / "ckpt")
    assert torch.equal(own.get_state(), before)
