"""Checkpoints: exact resume (one and two processes), pruning, and refusing bad folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gpukit as gk

TOTAL_STEPS = 12  # 1.5 epochs of 64 samples at a global batch of 8


def _run(rt: gk.Runtime, folder: str, stop_at: int | None, resume: bool) -> dict | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=8 // rt.world_size, shuffle=True)
    model, optimizer, loader = rt.setup(model, optimizer, loader)
    if resume:
        rt.load(folder)
    while rt.global_step < TOTAL_STEPS:
        for x, y in loader:
            rt.backward(nn.functional.mse_loss(model(x), y))
            rt.step(optimizer)
            if rt.global_step == stop_at:
                rt.save(folder)
                return None
            if rt.global_step == TOTAL_STEPS:
                break
    return {k: v.numpy().copy() for k, v in rt.unwrap(model).state_dict().items()}


@pytest.mark.parametrize(
    "devices",
    [["cpu"], pytest.param(["cpu", "cpu"], marks=pytest.mark.processes)],
    ids=["1-process", "2-process"],
)
def test_interrupted_and_resumed_run_is_bitwise_identical(
    tmp_path: Path, devices, monkeypatch: pytest.MonkeyPatch
) -> None:
    def runtime() -> gk.Runtime:
        return gk.Runtime(devices=devices, seed=0)

    straight = runtime().launch(_run, str(tmp_path / "unused"), None, False)
    assert runtime().launch(_run, str(tmp_path / "ck"), 5, False) is None  # stops mid-epoch 0
    # The resume starts cold: rt.launch's default start of its ranks, under the bitwise
    # guarantee, and fresh interpreters resuming what forked ones saved.
    monkeypatch.delenv("GPUKIT_WARM_START", raising=False)
    resumed = runtime().launch(_run, str(tmp_path / "ck"), None, True)
    for name in straight:
        assert np.array_equal(straight[name], resumed[name]), name


def _setup(tmp_path: Path) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    return rt, model, optimizer


def test_keeps_the_last_k_and_points_latest_at_the_newest(tmp_path: Path) -> None:
    rt, model, optimizer = _setup(tmp_path)
    for _ in range(4):
        rt.backward(model(torch.ones(1, 2)).sum())
        rt.step(optimizer)
        rt.save(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step-00000003",
        "step-00000004",
    ]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    assert sorted(p.name for p in (tmp_path / "step-00000004").iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "state.pt",
    ]


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path)
    with pytest.raises(gk.ConfigError, match=r"no checkpoint in .* \(no 'latest' file there\)"):
        rt.load(tmp_path / "nothing-here")


def test_corrupt_checkpoint_is_refused_and_left_untouched(tmp_path: Path) -> None:
    rt, model, _ = _setup(tmp_path)
    saved = rt.save(tmp_path)
    (saved / "state.pt").write_bytes(b"not a checkpoint")
    before = {p.name: p.read_bytes() for p in saved.iterdir()}
    weights = model.weight.detach().clone()
    with pytest.raises(gk.ConfigError, match=r"state.pt has 16 bytes, .* Nothing was changed"):
        rt.load(tmp_path)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == before
    assert torch.equal(model.weight, weights)


def test_checkpoint_that_would_run_code_is_refused(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path)
    saved = rt.save(tmp_path)
    (saved / "manifest.json").unlink()  # as a checkpoint from before manifests
    torch.save({"format": 1, "evil": Path("/")}, saved / "state.pt")  # an arbitrary object
    with pytest.raises(gk.ConfigError, match=r"holds objects that are not plain tensors"):
        rt.load(tmp_path)


def test_latest_naming_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    rt, _, _ = _setup(tmp_path)
    (tmp_path / "latest").write_text("step-00000099\n")
    with pytest.raises(gk.ConfigError, match=r"step-00000099 \(named by .*\) is missing"):
        rt.load(tmp_path)


def _sequential_run(tmp_path: Path, batch_size: int, batches: int, resume: bool) -> list[int]:
    """Read ``batches`` batches of the indices 0..29 in order; the indices seen."""
    rt = gk.Runtime(devices="cpu", seed=0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(30))
    model, optimizer, loader = rt.setup(model, optimizer, DataLoader(data, batch_size=batch_size))
    if resume:
        rt.load(tmp_path)
    seen: list[int] = []
    for (index,) in loader:
        seen += index.tolist()
        rt.backward(model(index[:, None].float()).sum())
        rt.step(optimizer)
        if len(seen) == batches * batch_size:
            break
    if not resume:
        rt.save(tmp_path)
    return seen


def test_resuming_with_another_batch_size_goes_on_from_the_same_sample(tmp_path: Path) -> None:
    assert _sequential_run(tmp_path, 4, 3, resume=False) == list(range(12))
    assert _sequential_run(tmp_path, 6, 2, resume=True) == list(range(12, 24))


def test_a_batch_size_that_does_not_divide_the_samples_seen_warns(tmp_path: Path) -> None:
    _sequential_run(tmp_path, 4, 3, resume=False)  # 12 samples seen
    with pytest.warns(UserWarning, match=r"after 12 samples .* goes on from sample 10, so 2 "):
        assert _sequential_run(tmp_path, 5, 1, resume=True) == list(range(10, 15))


def test_a_resume_with_more_accumulation_opens_a_fresh_window(tmp_path: Path) -> None:
    # Saved after step 3 with accumulate=1 (micro-step 3), resumed with accumulate=2 (fewer
    # ranks, the same global batch): the next two micro-batches make one optimizer step.
    def build(accumulate: int) -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
        rt = gk.Runtime(devices="cpu", seed=0, accumulate=accumulate)
        model = nn.Linear(2, 1)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt, model, opt

    rt, model, opt = build(1)
    for _ in range(3):
        rt.backward(model(torch.ones(4, 2)).pow(2).mean())
        rt.step(opt)
    rt.save(tmp_path)
    rt, model, opt = build(2)
    rt.load(tmp_path)
    assert (rt.global_step, rt.state.micro_step) == (3, 6)
    stepped = []
    for _ in range(2):
        rt.backward(model(torch.ones(4, 2)).pow(2).mean())
        stepped.append(rt.step(opt))
    assert stepped == [False, True] and rt.global_step == 4


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_of_a_checkpoint_gets_the_mode_the_umask_gives(
    tmp_path: Path, umask: int
) -> None:
    import os
    import stat

    previous = os.umask(umask)
    try:
        rt = gk.Runtime(devices="cpu")
        model = nn.Linear(3, 2)
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        saved = rt.save(tmp_path / "checkpoints")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in Path(saved).rglob("*") if p.is_file()}
    assert "model.safetensors" in modes and "state.pt" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_the_epoch_a_load_returns_is_the_passes_run_to_their_end(tmp_path: Path) -> None:
    """Also the 0-based pass a resumed loop is in: the one a save was made in, or the next
    after a save at a pass's end."""
    rt = gk.Runtime(devices="cpu")
    net = nn.Linear(2, 1)
    data = DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=2)
    model, optimizer, loader = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), data)
    for x, y in loader:  # pass 0, run to its end
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(optimizer)
    after_pass = rt.save(tmp_path / "a")
    for x, y in loader:  # pass 1: saved in the middle
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(optimizer)
        middle = rt.save(tmp_path / "b")
        break
    assert rt.load(after_pass) == {"epoch": 1, "step": 2}
    assert rt.load(middle) == {"epoch": 1, "step": 3}
    alone = gk.Runtime(devices="cpu")
    alone.setup(nn.Linear(2, 1))
    assert alone.load(alone.save(tmp_path / "c")) == {"epoch": 0, "step": 0}  # no loader
