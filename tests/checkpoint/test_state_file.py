"""The file form of a Fabric program, ``rt.save(path, state)`` and ``rt.load(path, state)``:
a resume bit for bit on one and two processes, what a load returns, and each call whose form
cannot be told, or whose file cannot be read, refused."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.errors import ConfigError, OutputWriteError

SAVE_AT, STEPS = 3, 6


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for a step on every run: the file form keeps no data position."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)


def _train(rt: gk.Runtime, path: str, phase: str) -> dict[str, torch.Tensor]:
    """``phase``: "straight" trains all the steps and saves at SAVE_AT; "resumed" loads that
    file and trains the rest."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    model, optimizer, scheduler = rt.setup(model, optimizer, scheduler)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    first = 0
    if phase == "resumed":
        first = rt.load(path, state)["step"]
        assert first == SAVE_AT
    for step in range(first, STEPS):
        x, y = _batch(step, rt.rank)
        rt.backward(nn.functional.mse_loss(model(x), y))
        rt.step(optimizer)
        scheduler.step()
        if phase == "straight" and step + 1 == SAVE_AT:
            rt.save(path, {**state, "step": SAVE_AT})
    return rt.full_state_dict(model)  # fsdp's shards gathered on rank 0


@pytest.mark.parametrize(
    "devices, strategy",
    [
        pytest.param("cpu", "auto", id="one-process"),
        pytest.param(["cpu", "cpu"], "ddp", marks=pytest.mark.processes, id="ddp-2-ranks"),
        pytest.param(
            ["cpu", "cpu"],
            "fsdp",
            marks=[pytest.mark.slow, pytest.mark.processes],
            id="fsdp-2-ranks",
        ),
    ],
)
def test_a_run_resumed_from_the_file_ends_with_the_same_weights_bit_for_bit(
    tmp_path: Path, devices: Any, strategy: str
) -> None:
    path = str(tmp_path / "run.pt")
    straight = gk.Runtime(devices=devices, strategy=strategy).launch(_train, path, "straight")
    resumed = gk.Runtime(devices=devices, strategy=strategy).launch(_train, path, "resumed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def _reads_back(rt: gk.Runtime, path: str) -> tuple[Any, Any, list[float], int]:
    """Saved under ddp, read by each rank: the file holds the user's model, unwrapped."""
    model = rt.setup(nn.Linear(2, 1))
    rt.save(path, {"model": model, "seen": rt.rank + 10})
    whole = rt.load(path)
    return sorted(whole["model"]), whole["seen"], rt.all_gather(torch.tensor([1.0])).tolist(), 0


@pytest.mark.processes
def test_under_ddp_rank_0_writes_the_unwrapped_model_and_every_rank_reads_it(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "run.pt")
    names, seen, _, _ = gk.Runtime(devices=["cpu", "cpu"], strategy="ddp").launch(_reads_back, path)
    assert names == ["bias", "weight"]  # no "module." prefix of DDP's wrapper
    assert seen == 10  # rank 0's value
    assert torch.load(path, weights_only=True)["seen"] == 10


def _runtime_and_model() -> tuple[gk.Runtime, nn.Module, torch.optim.Optimizer]:
    rt = gk.Runtime(devices="cpu")
    net = nn.Linear(2, 1)
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    return rt, model, optimizer


def test_load_fills_state_in_place_and_returns_what_state_does_not_name(tmp_path: Path) -> None:
    rt, model, optimizer = _runtime_and_model()
    path = tmp_path / "run.pt"
    saved_weight = model.weight.detach().clone()
    assert rt.save(path, {"model": model, "optimizer": optimizer, "epoch": 4, "best": 0.5}) == path
    with torch.no_grad():
        model.weight.add_(1.0)
    state: dict[str, Any] = {"model": model, "epoch": 0}
    rest = rt.load(path, state)
    assert torch.equal(model.weight, saved_weight)
    assert state["epoch"] == 4  # a plain value is replaced by the file's, as Fabric does
    assert sorted(rest) == ["best", "optimizer"]
    whole = rt.load(path)  # without a state: the whole dict, as plain data
    assert sorted(whole) == ["best", "epoch", "model", "optimizer"]
    assert torch.equal(whole["model"]["weight"], saved_weight)


def test_a_tensor_in_state_comes_back_where_it_was(tmp_path: Path) -> None:
    rt, _, _ = _runtime_and_model()
    path = tmp_path / "run.pt"
    rt.save(path, {"losses": torch.arange(3.0)})
    state = {"losses": torch.zeros(3)}
    assert rt.load(path, state) == {}
    assert state["losses"].tolist() == [0.0, 1.0, 2.0]


def test_calls_whose_form_cannot_be_told_are_refused_at_the_call(tmp_path: Path) -> None:
    rt, model, _ = _runtime_and_model()
    with pytest.raises(ConfigError, match=r"without a state.*rt.save\('.*run.pt', \{'model'"):
        rt.save(tmp_path / "run.pt")
    with pytest.raises(ConfigError, match="keep and export are for a checkpoint folder"):
        rt.save(tmp_path / "run.pt", {"model": model}, keep=2)
    with pytest.raises(ConfigError, match="that is a folder; the file form writes one file"):
        rt.save(tmp_path, {"model": model})
    with pytest.raises(ConfigError, match="needs the file to write"):
        rt.save(None, {"model": model})
    with pytest.raises(ConfigError, match="got a state of int: give a dict"):
        rt.save(tmp_path / "ckpt", 2)  # type: ignore[arg-type]  # keep given by position
    folder = rt.save(tmp_path / "ckpt")  # the folder form is unchanged
    with pytest.raises(ConfigError, match="that is a checkpoint folder"):
        rt.load(tmp_path / "ckpt", {"model": model})
    assert rt.load(folder) == {"epoch": 0, "step": 0}
    with pytest.raises(ConfigError, match="no such file"):
        rt.load(tmp_path / "missing.pt")
    with pytest.raises(ConfigError, match="no such file"):
        rt.load(tmp_path / "missing", {"model": model})
    with pytest.raises(ConfigError, match="needs the file to read"):
        rt.load(None, {"model": model})


def test_what_a_file_cannot_hold_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    rt, model, _ = _runtime_and_model()
    path = tmp_path / "run.pt"
    with pytest.raises(ConfigError, match=r"state\['fn'\] is a function"):
        rt.save(path, {"model": model, "fn": lambda: 0})
    with pytest.raises(ConfigError, match="the key 3 is a int"):
        rt.save(path, {3: model})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="got a state of list"):
        rt.save(path, [model])  # type: ignore[arg-type]
    assert not path.exists()


def test_a_file_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    rt, model, optimizer = _runtime_and_model()
    path = tmp_path / "run.pt"
    rt.save(path, {"model": model, "epoch": 1})
    before = model.weight.detach().clone()
    state: dict[str, Any] = {"model": model, "epoch": 0, "optimizer": None}
    with pytest.raises(ConfigError, match=r"has no 'optimizer'.*nothing was changed"):
        rt.load(path, state)
    assert state["epoch"] == 0
    other = nn.Linear(3, 1)
    with pytest.raises(ConfigError, match=r"'model' does not fit.*weight: file \(1, 2\), model"):
        rt.load(path, {"model": other, "epoch": 0})
    with pytest.raises(ConfigError, match="give a dict of what to fill"):
        rt.load(path, ["model"])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'epoch' is a int in the file, not the state of the"):
        rt.load(path, {"model": model, "epoch": optimizer})
    assert torch.equal(model.weight, before)


class _Unplain:
    pass


def test_a_file_of_pickled_objects_is_refused_never_run(tmp_path: Path) -> None:
    rt, _, _ = _runtime_and_model()
    path = tmp_path / "objects.pt"
    path.write_bytes(pickle.dumps({"thing": _Unplain()}, protocol=2))
    with pytest.raises(ConfigError, match=r"cannot be read as plain data.*nothing was changed"):
        rt.load(path)
    listed = tmp_path / "list.pt"
    torch.save([1, 2], listed)
    with pytest.raises(ConfigError, match="holds a list, not a dict"):
        rt.load(listed)


def test_a_write_the_disk_refuses_is_one_output_write_error(tmp_path: Path) -> None:
    rt, model, _ = _runtime_and_model()
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder goes")
    with pytest.raises(OutputWriteError, match=r"could not write .*blocker"):
        rt.save(blocker / "run.pt", {"model": model})
    path = tmp_path / "run.pt"
    rt.save(path, {"epoch": 1})
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]  # nothing left over
    assert rt.load(path) == {"epoch": 1}


def _sgd_before_a_step(rt: gk.Runtime, path: str) -> float:
    """An optimizer that keeps nothing per parameter yet (SGD, no momentum): its settings alone
    come back."""
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    rt.save(path, {"model": model, "optimizer": optimizer})
    optimizer.param_groups[0]["lr"] = 0.5
    rt.load(path, {"model": model, "optimizer": optimizer})
    return float(optimizer.param_groups[0]["lr"])


@pytest.mark.slow
@pytest.mark.processes
def test_under_fsdp_an_optimizer_without_state_loads_its_settings(tmp_path: Path) -> None:
    rt = gk.Runtime(devices=["cpu", "cpu"], strategy="fsdp")
    assert rt.launch(_sgd_before_a_step, str(tmp_path / "run.pt")) == 0.1


def _two_groups(net: nn.Sequential) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        [{"params": net[0].parameters()}, {"params": net[1].parameters(), "lr": 0.5}], lr=0.1
    )


def test_an_optimizer_that_does_not_fit_is_refused_before_the_model_changes(
    tmp_path: Path,
) -> None:
    rt = gk.Runtime(devices="cpu")
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model, optimizer = rt.setup(net, _two_groups(net))
    rt.backward(model(torch.ones(3, 2)).sum())
    rt.step(optimizer)  # Adam keeps its moments: state tensors to compare
    path = tmp_path / "run.pt"
    rt.save(path, {"model": model, "optimizer": optimizer})
    with torch.no_grad():
        model[0].weight.add_(1.0)
    before = [p.detach().clone() for p in model.parameters()]

    one_group = torch.optim.Adam(model.parameters(), lr=0.1)
    with pytest.raises(
        ConfigError, match=r"'optimizer' does not fit.*2 parameter group\(s\), the optimizer 1"
    ):
        rt.load(path, {"model": model, "optimizer": one_group})
    split = torch.optim.Adam(
        [{"params": [model[0].weight]}, {"params": [model[0].bias, *model[1].parameters()]}]
    )
    with pytest.raises(ConfigError, match=r"group 0 holds 2 parameter\(s\) in the file, 1 in"):
        rt.load(path, {"model": model, "optimizer": split})
    other = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    with pytest.raises(ConfigError, match=r"'exp_avg' is \(2, 2\) in the file, \(3, 2\) here"):
        rt.load(path, {"model": model, "optimizer": _two_groups(other)})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))

    rt.load(path, {"model": model, "optimizer": optimizer})  # the one it was saved from fits
    assert not torch.equal(model[0].weight, before[0])


def _refused_on_rank_1_only(rt: gk.Runtime, path: str) -> tuple[str, str, bool]:
    """A value the file cannot hold on rank 1 alone: every rank says the same refusal."""
    model = rt.setup(nn.Linear(2, 1))
    best: Any = 5 if rt.rank == 0 else np.int64(5)
    try:
        rt.save(path, {"model": model, "best": best})
        said = "saved"
    except ConfigError as err:
        said = str(err)
    rt.barrier()  # the ranks still meet: none was left behind in the save
    return said, rt.broadcast(said, src=1), Path(path).exists()


@pytest.mark.processes
def test_a_state_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "run.pt")
    rt = gk.Runtime(devices=["cpu", "cpu"], strategy="ddp")
    on_rank_0, on_rank_1, written = rt.launch(_refused_on_rank_1_only, path)
    assert on_rank_0 == on_rank_1
    assert re.search(r"state\['best'\] is a .*int64.*cannot hold", on_rank_0), on_rank_0
    assert not written
